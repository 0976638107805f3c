"""A real recorded trace of a tiny Pipe, shared by the pipe.viz tests."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipe import Pipe, trace


def record_steps(steps: int, chunks: int = 4, checkpoint: str = "except_last") -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    piped = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[2, 3], devices=["cpu", "cpu"])
    with trace.record(schedule="gpipe", checkpoint=checkpoint) as recorder:
        for _ in range(steps):
            piped(torch.randn(8, 8)).square().mean().backward()
    piped.close()
    return recorder.trace()


@pytest.fixture
def pipe_trace() -> dict[str, Any]:
    """Two training steps of a 2-stage Pipe, 4 micro-batches, checkpoint="except_last"."""
    return record_steps(2)
