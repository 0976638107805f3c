"""Failures across ranks: the job ends in bounded time, every rank names the failed rank and the cause."""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dist_models import WIDTH
from pipe.distributed import DistributedPipe, PipelineFailure, failure
from pipe.distributed.transport import PeerError
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


def _hang(rank: int, world: int) -> str:
    """Rank 1 hangs 30 s in step 3; rank 0 returns its error once rank 1's process has ended."""
    pipe = DistributedPipe(_model(30.0), chunks=2, checkpoint="never", schedule="1f1b")
    failures = pipe._runtime.failures
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    try:
        for step in range(4):
            pipe.step(x, y, F.mse_loss)
            if step == 0:  # as in _fail: a 1 s timeout once the ranks are connected
                pipe._runtime.transport.timeout = datetime.timedelta(seconds=1)
                failures.timeout = 1.0
    except PipelineFailure as error:
        # Rank 0 hosts the store here: it stays until rank 1's process (on this machine) has ended.
        # (A deadline past the hang only, so that a rank 1 left hanging wakes, raises and returns: caught below.)
        raised = time.monotonic()
        pid, start = failures._local_process(1) or (0, "?")
        while not failure._gone(pid, start) and time.monotonic() - raised < 60.0:
            time.sleep(0.05)
        return f"PipelineFailure: {error}"
    return "no error"


def test_hanging_rank_ends_the_job_after_the_timeout_and_ends_itself() -> None:
    # Rank 1 hangs far longer than the timeout (1 s): rank 0 gives up, naming rank 1 as the rank that stalled,
    # and rank 1's watchdog reads that headline and ends its process (exit status 75) instead of hanging on.
    peer, hung = run_ranks(_hang, 2, barrier=False, expect_missing=(1,))
    assert peer.startswith("PipelineFailure: rank 0 stopped in"), peer
    assert "because rank 1 stalled: it did not answer within the 1 s timeout" in peer, peer
    # It never returned: its watchdog ended the process during the hang (a rank left to its 30 s hang wakes,
    # raises and returns its error), whatever the machine's speed.
    assert hung is None


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


def _evidence(monkeypatch: pytest.MonkeyPatch, dead_pids: dict[int, int]) -> failure.Failures:
    """Rank 1 of 4 on an in-process store that holds rank 1's timeout on rank 3 at step 1; ranks 2 and 3
    published nothing. ``dead_pids`` gives a rank the identity of a process that has ended."""
    store = dist.HashStore()
    monkeypatch.setattr(failure, "_store", lambda: store)
    monkeypatch.setattr(failure, "_SETTLE", 0.1)
    failures = failure.Failures(rank=1, world=4, timeout=0.2)
    for rank in (0, 2, 3):
        pid = dead_pids.get(rank, os.getpid())
        store.set(f"pipe/{failures.instance}/process/{rank}", f"{socket.gethostname()} {pid} "
                  f"{failure._start_time(os.getpid()) if rank not in dead_pids else '12345'}")
    failures.begin_step()
    store.set(failures._key("lost/0"), "? timeout B0@1")
    return failures


def _ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_timeout_on_a_live_partner_blames_the_silent_rank_whose_process_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 waits on rank 2 (a shard partner that exited) and its own timeout is not out yet: rank 1's
    timeout on rank 3 must not blame rank 3 as stalled (the fault matrix's fsdp-exit flake)."""
    failures = _evidence(monkeypatch, {2: _ended_pid()})
    error = failures.failure_from("B0@1", PeerError("wait on rank 3 timed out", peer=3))
    assert str(error).startswith("rank 1 stopped in B0@1 because rank 2 died: its process"), error
    assert "found when rank 1's wait in B0@1 timed out" in str(error)


def test_a_timeout_on_a_silent_partner_blames_it_as_stalled_when_no_process_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    failures = _evidence(monkeypatch, {})
    error = failures.failure_from("B0@1", PeerError("wait on rank 3 timed out", peer=3))
    assert str(error).startswith("rank 1 stopped in B0@1 because rank 3 stalled: it did not answer"), error
