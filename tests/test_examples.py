"""Smoke tests for examples/: each script runs to the end with tiny settings.

The examples are what a newcomer runs first, so they are run the way a newcomer
runs them: as a separate ``python`` process from the repository root, with the
checkout importable even when ``pipe`` is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )


@pytest.mark.timeout(60)
def test_quickstart() -> None:
    proc = run_example("quickstart.py")
    check(proc)
    assert "quickstart: outputs and gradients match the plain model" in proc.stdout


@pytest.mark.timeout(60)
def test_transformer_lm_tiny() -> None:
    proc = run_example(
        "transformer_lm.py",
        *("--steps", "3", "--layers", "2", "--width", "32", "--seq-len", "32", "--batch-size", "8"),
        *("--eval-every", "2", "--eval-batches", "2", "--sample", "--sample-chars", "8"),
    )
    check(proc)
    out = proc.stdout
    assert "balance [2, 2], chunks 4, checkpoint 'except_last'" in out
    assert "step 2: train loss" in out  # --eval-every
    assert "sample:\nThe " in out  # --sample
    assert "done: 3 steps, loss " in out.splitlines()[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_transformer_lm_checkpoint_modes(checkpoint: str) -> None:
    proc = run_example(
        "transformer_lm.py",
        *("--steps", "2", "--layers", "3", "--width", "32", "--seq-len", "16", "--batch-size", "8"),
        *("--chunks", "2", "--checkpoint", checkpoint, "--dropout", "0.1", "--eval-batches", "1"),
    )
    check(proc)
    assert f"balance [2, 3], chunks 2, checkpoint '{checkpoint}'" in proc.stdout
    assert "done: 2 steps, loss " in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_huggingface_lm_tiny(arch: str) -> None:
    pytest.importorskip("transformers")
    proc = run_example(
        "huggingface_lm.py",
        *("--arch", arch, "--steps", "3", "--layers", "2", "--width", "32", "--seq-len", "16", "--batch-size", "8"),
        timeout=120,
    )
    check(proc)
    out = proc.stdout
    assert f"{arch}: " in out and "into 2 partitions, chunks 4, checkpoint 'except_last'" in out
    assert "checkpoint loads into" in out and ": yes," in out.splitlines()[-1]
    assert out.splitlines()[-1].startswith("done: 3 steps, loss ")
