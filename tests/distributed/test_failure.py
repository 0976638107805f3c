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


def test_a_connection_reset_or_closed_by_gloo_is_a_lost_peer_not_this_ranks_own_error() -> None:
    from pipe.distributed.failure import _peer_of

    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4225: Connection reset by peer. "
                         "This is typically caused by a remote worker hanging")
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46259")
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation")
    assert _peer_of(reset) == (None, False)  # the peer is not known: the rank that published nothing is blamed
    assert _peer_of(closed) == (None, False)
    assert _peer_of(timeout) == (None, True)
    assert _peer_of(ValueError("boom in layer 3")) is None  # this rank's own error
    assert _peer_of(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
