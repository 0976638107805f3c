"""Run a function on several gloo ranks on 127.0.0.1, with a deadline so that a hang fails.

The ranks come from the library's one way to start local ranks,
:func:`pipe.distributed.local_ranks.run_local_ranks` (cause-first failures,
fault-handler stacks, a free port retried); this adds the tests' policy: a
failure is an ``AssertionError``, and a rank that crashed in C++ is started
once more with a warning.

Each test spawns as few process groups as it can (a spawn costs seconds on two
cores) and checks several things per spawn. Where no GPU is visible ranks are
forked, so the function may be defined in the test module; each rank compares
against the plain model itself and returns plain Python values (tensors are
not sent back).

Where a GPU is visible (or torch is older than 2.13, see ``_OLD_TORCH``), ranks come from a fork server instead
(:func:`pipe.distributed.local_ranks.rank_processes`, which says why): a pytest worker
runs many tests, so any of them may have used CUDA or run a backward before a
fork. The server's ranks get their function and arguments by pickling: rank
functions live at module level. (On the CPU, the 105 multi-process tests took
172 s forked, 211 s from the fork server and 460 s spawned, on 2 workers; the
first GPU run spawned, and its suite outran its time limit.)
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Collection, Optional

import torch
import torch.distributed as dist

from pipe.distributed.local_ranks import CRASHED, RankFailure, free_port, run_local_ranks

__all__ = ["CRASHED", "DEADLINE", "free_port", "hold_the_store", "run_ranks"]

# torch 2.11 (its CUDA build, on a CPU machine too) refuses a backward in a rank forked from a pytest worker that
# ran a split LLaMA's pipeline before ("Unable to handle autograd's threading in combination with fork-based
# multiprocessing"); 2.13 does not. Those ranks come from the fork server, as where a GPU is visible.
_OLD_TORCH = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
DEADLINE = 90.0  # seconds for a whole spawn; a hang fails the test instead of blocking CI


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 20.0,
              deadline: float = DEADLINE, env: Optional[dict[str, str]] = None, barrier: bool = True,
              expect_missing: Collection[int] = (), start_method: Optional[str] = None) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks; returns each rank's result.

    Args:
        timeout: the process-group timeout of each rank.
        deadline: the whole run's limit; past it the ranks are killed and the test fails.
        barrier: wait for every rank before exiting (off when ranks are meant to fail).
        expect_missing: ranks meant to die without returning (their result is None).
        start_method: ``"fork"``, ``"forkserver"``, ``"spawn"`` or ``"interpreter"``; default
            ``$PIPE_TEST_START_METHOD``, else the fork server where a GPU is visible or torch is older
            than 2.13, else fork.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or the deadline passed.
    """
    method = start_method or os.environ.get("PIPE_TEST_START_METHOD") or (
        "forkserver" if torch.cuda.is_available() or _OLD_TORCH else "fork")
    for attempt in range(2):
        try:
            return run_local_ranks(fn, world, *args, timeout=timeout, deadline=deadline, env=env, barrier=barrier,
                                   expect_missing=expect_missing, start_method=method)
        except RankFailure as error:
            # A rank that died inside the C++ of gloo or of the forked interpreter (a signal, not a Python error
            # and not our deadline) was seen once in CI under load and never here in 70 runs: spawn once more,
            # say so in the warnings summary, and fail if it happens again.
            crashes = {rank: how for rank, how in error.ended.items() if how.startswith(CRASHED)}
            if crashes and not attempt:
                warnings.warn(f"{getattr(fn, '__name__', fn)}: ranks crashed, spawning once more: {crashes}")
                continue
            raise AssertionError(str(error)) from None
    raise AssertionError("unreachable")  # pragma: no cover


def hold_the_store(rank: int, world: int) -> None:
    """Call last in a rank function run with ``barrier=False``: rank 0, whose process hosts the store of ranks
    started by :func:`run_ranks`, returns only once every rank has called it, so that no rank's last store request
    meets a store whose host has exited (``Connection reset by peer``)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("test/returning", 1)
    while rank == 0 and int(store.add("test/returning", 0)) < world:
        time.sleep(0.05)
