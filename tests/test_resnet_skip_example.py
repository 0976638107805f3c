"""Smoke test for examples/resnet_skip.py: skips, deferred BatchNorm and balance_by_time end to end."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_resnet_skip_runs() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resnet_skip.py"), "--steps", "2", "--batch", "16",
         "--profile-seconds", "0.05", "--checkpoint", "always"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("balance [") and "test accuracy" in summary
