"""Stage-agnostic checkpoints: saved with 2 stages, resumed with 4 stages and into the plain module, same losses."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dist_models import WIDTH
from pipe.distributed import DistributedPipe, state
from spawn_ranks import run_ranks


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(8)])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)


def _train(pipe: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _data(step)
        if isinstance(pipe, DistributedPipe):
            loss = pipe.step(x, y, F.mse_loss, broadcast_loss=True)
        else:
            loss = F.mse_loss(pipe(x), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _save_and_resume(rank: int, world: int, path: str) -> tuple[list[float], list[float]]:
    # 2 stages (one per rank): 2 steps, save, 2 more steps = the reference curve.
    pipe = DistributedPipe(_model(0), chunks=2, schedule="1f1b")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    _train(pipe, optimizer, range(2))
    state.save(path, pipe, optimizer, step=2)
    reference = _train(pipe, optimizer, range(2, 4))
    # 4 stages (two per rank, interleaved), from other initial weights: load, then the same 2 steps.
    resumed = DistributedPipe(_model(1), chunks=2, schedule="interleaved", virtual_stages=2, balance=[1, 3, 3, 1])
    optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    extra = state.load(path, resumed, optimizer)
    assert extra == {"step": 2}, extra
    return reference, _train(resumed, optimizer, range(2, 4))


def test_resume_with_another_stage_count_and_into_the_plain_module(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    (reference, resumed), again = run_ranks(_save_and_resume, 2, path)
    assert again == (reference, resumed)
    assert resumed == reference  # 4 stages continue exactly where 2 stages stopped
    # The plain module, in this process (no process group), continues the same curve.
    plain = _model(2)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    assert state.load_module(path, plain, optimizer) == {"step": 2}
    torch.testing.assert_close(_train(plain, optimizer, range(2, 4)), reference)
