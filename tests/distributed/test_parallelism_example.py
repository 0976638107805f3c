"""launch/parallelism.sh runs examples/parallelism.py on 4 ranks as the docs say; its checkpoint loads into the plain model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from pipe.distributed import state
from torchrun_launch import aborted_at_exit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from parallelism import decoder  # noqa: E402


def test_launcher_trains_tensor_parallel_and_saves_a_checkpoint_the_plain_model_loads(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",  # 4 ranks on the CPU path (gloo), as on CI
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = ["bash", str(ROOT / "launch" / "parallelism.sh"), "--layout", "tp-sp", "--steps", "2",
               "--save", str(tmp_path / "ckpt")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    if aborted_at_exit(done.returncode, done.stderr + done.stdout, "done: layout tp-sp"):  # once more
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "done: layout tp-sp, 2 steps from step 0, loss" in done.stderr + done.stdout
    plain = decoder(vocab=256, width=64, heads=4, blocks=4, seed=1)  # the example's default sizes
    before = plain[1].attn.q.weight.detach().clone()
    assert state.load_module(tmp_path / "ckpt", plain) == {"step": 2}
    assert not torch.equal(plain[1].attn.q.weight, before)  # the gathered tp shards replaced it
