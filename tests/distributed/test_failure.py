"""Failures across ranks: the job ends in bounded time, every rank names the failed rank and the cause."""
from __future__ import annotations

import datetime
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dist_models import WIDTH
from pipe.distributed import DistributedPipe, PipelineFailure
from spawn_ranks import run_ranks


class Faulty(nn.Module):
    """Raises (or hangs) in the forward of the step given, on the rank that owns it."""

    def __init__(self, fail_at_call: int, hang: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.fail_at_call = fail_at_call
        self.hang = hang

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.fail_at_call:
            if self.hang:
                time.sleep(self.hang)
            else:
                raise ValueError("boom in layer 3")
        return self.linear(x)


def _model(hang: float) -> nn.Sequential:
    torch.manual_seed(0)
    # Layer 3 is on rank 1; with chunks=2 its 5th call is step 3's first micro-batch.
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), Faulty(5, hang))


def _fail(rank: int, world: int, hang: float) -> str:
    pipe = DistributedPipe(_model(hang), chunks=2, checkpoint="never", schedule="1f1b")
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    try:
        for step in range(4):
            pipe.step(x, y, F.mse_loss)
            if step == 0:
                # The first step also connects the ranks (slow on a loaded machine); from now on a
                # wait gives up after 1 s, as if init_process_group(timeout=1 s) had been passed.
                pipe._runtime.transport.timeout = datetime.timedelta(seconds=1)
                pipe._runtime.failures.timeout = 1.0
    except PipelineFailure as failure:
        return f"PipelineFailure: {failure}"
    except ValueError as error:
        return f"ValueError: {error} | {getattr(error, '__notes__', [])}"
    except RuntimeError as error:
        return f"RuntimeError: {error} | {getattr(error, '__notes__', [])}"
    return "no error"


def test_exception_on_one_rank_ends_every_rank_naming_it() -> None:
    # Rank 1 raises and its process ends; rank 0, blocked in a receive, learns who failed and why.
    failed, peer = run_ranks(_fail, 2, 0.0, barrier=False)[::-1]
    assert failed.startswith("ValueError: boom in layer 3"), failed
    assert "rank 1 failed in F0@1" in failed, failed
    assert peer.startswith("PipelineFailure: rank 0 stopped in"), peer
    assert "because rank 1 failed in F0@1: ValueError: boom in layer 3" in peer, peer


def test_hanging_rank_ends_the_job_after_the_timeout() -> None:
    # Rank 1 hangs longer than the timeout (1 s): rank 0 gives up, naming rank 1 as the rank that stalled.
    peer, hung = run_ranks(_fail, 2, 2.5, barrier=False)
    assert peer.startswith("PipelineFailure: rank 0 stopped in"), peer
    assert "because rank 1 stalled: it did not answer within the 1 s timeout" in peer, peer
    # Rank 1 wakes up to find rank 0 gone (with the store it hosted here; under torchrun the agent
    # hosts it and rank 1 would read the agreed headline naming itself).
    assert hung.startswith("PipelineFailure: rank 1 stopped in"), hung
    assert "rank 0" in hung, hung
