"""Run a function on several gloo ranks on 127.0.0.1, with a deadline so that a hang fails.

Each test spawns as few process groups as it can (a spawn costs seconds on two
cores) and checks several things per spawn. Ranks are forked, so the function
may be defined in the test module; each rank compares against the plain
model itself and returns plain Python values (tensors are not sent back).

Where a GPU is visible, ranks come from a fork server instead
(:func:`pipe.distributed.env.rank_processes`, which says why): a pytest worker
runs many tests, so any of them may have used CUDA or run a backward before a
fork. The server's ranks get their function and arguments by pickling: rank
functions live at module level. (On
the CPU, the 105 multi-process tests took 172 s forked, 211 s from the fork
server and 460 s spawned, on 2 workers; the first GPU run spawned, and its
suite outran its time limit.)
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Collection, Optional

import torch
import torch.distributed as dist

from pipe.distributed import init_from_env
from pipe.distributed.env import rank_processes
from torchrun_launch import free_port

CRASHED = "killed by signal"
DEADLINE = 90.0  # seconds for a whole spawn; a hang fails the test instead of blocking CI


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: "multiprocessing.Queue[Any]", timeout: float, env: dict[str, str], barrier: bool,
           crash_log: str) -> None:
    faulthandler.enable(open(crash_log, "w"), all_threads=True)  # a rank that dies in C++ leaves its stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), **env)
    torch.set_num_threads(1)
    try:
        init_from_env("gloo", timeout=timeout)  # seconds
        result = fn(rank, world, *args)
        if barrier:
            dist.barrier()  # keep the store (hosted by rank 0) alive until every rank is done
        results.put((rank, True, result))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 20.0,
              deadline: float = DEADLINE, env: Optional[dict[str, str]] = None, barrier: bool = True,
              expect_missing: Collection[int] = (), start_method: Optional[str] = None) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks; returns each rank's result.

    Args:
        timeout: the process-group timeout of each rank.
        deadline: the whole run's limit; past it the ranks are killed and the test fails.
        barrier: wait for every rank before exiting (off when ranks are meant to fail).
        expect_missing: ranks meant to die without returning (their result is None).
        start_method: ``"fork"``, ``"forkserver"`` or ``"spawn"``; default ``$PIPE_TEST_START_METHOD``, else
            :func:`pipe.distributed.env.rank_processes`'s (the fork server where a GPU is visible, else fork).

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or the deadline passed.
    """
    start_method = start_method or os.environ.get("PIPE_TEST_START_METHOD")
    crashed_before = False
    for _ in range(3):
        collected, deaths = _spawn(fn, world, args, timeout, deadline, env or {}, barrier, expect_missing,
                                   start_method)
        # A port found free may be taken before rank 0's store binds it: spawn again on another.
        if any(not ok and "EADDRINUSE" in str(payload) for ok, payload in collected.values()):
            continue
        # A rank that died inside the C++ of gloo or of the forked interpreter (a signal, not a Python error
        # and not our deadline) was seen once in CI under load and never here in 70 runs: spawn once more,
        # say so in the warnings summary, and fail if it happens again.
        crashes = {rank: how for rank, how in deaths.items() if how.startswith(CRASHED) and rank not in expect_missing}
        if crashes and not crashed_before:
            crashed_before = True
            warnings.warn(f"{getattr(fn, '__name__', fn)}: ranks crashed, spawning once more: {crashes}")
            continue
        break
    failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in _cause_first(collected) if not ok]
    missing = [rank for rank in range(world) if rank not in collected and rank not in expect_missing]
    if failures or missing:
        raise AssertionError("\n".join(failures) + (f"\nranks {missing} returned nothing (hang or crash)"
                                                     if missing else "")
                             + "".join(f"\nrank {rank}: {deaths[rank]}" for rank in missing if rank in deaths))
    return [collected[rank][1] if rank in collected else None for rank in range(world)]


def _cause_first(collected: dict[int, tuple[bool, Any]]) -> list[tuple[int, tuple[bool, Any]]]:
    """The ranks' results with a failed assertion first, then in the order they arrived.

    A rank whose check fails ends its process group, and its partners then fail with knock-on errors (gloo's
    "Connection reset by peer", pipe's verdict naming the rank): the cause is read first, not under them.
    """
    def cause(item: tuple[int, tuple[bool, Any]]) -> bool:
        ok, payload = item[1]
        lines = str(payload).strip().splitlines()
        return not ok and bool(lines) and lines[-1].startswith("AssertionError")
    arrived = list(collected.items())
    return sorted(arrived, key=lambda item: not cause(item))  # stable: the order of arrival otherwise


def _spawn(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float, deadline: float,
           env: dict[str, str], barrier: bool, expect_missing: Collection[int], start_method: Optional[str]
           ) -> tuple[dict[int, tuple[bool, Any]], dict[int, str]]:
    """One spawn of ``world`` ranks on a free port.

    Returns each rank's (ok, result or traceback) that came back, and for each rank that ended without one,
    how it ended (exit code or signal) and the stacks that Python's fault handler wrote, if any.
    """
    context = rank_processes(start_method)
    results: "multiprocessing.Queue[Any]" = context.Queue()
    port = free_port()
    logs = tempfile.TemporaryDirectory(prefix="pipe-ranks-")
    crash_logs = [os.path.join(logs.name, f"rank{rank}.txt") for rank in range(world)]
    processes = [
        context.Process(target=_child,
                        args=(rank, world, port, fn, args, results, timeout, env, barrier, crash_logs[rank]),
                        name=f"pipe-test-rank-{rank}", daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    collected: dict[int, tuple[bool, Any]] = {}
    killed: set[int] = set()
    end = time.monotonic() + deadline
    try:
        while len(collected) < world:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
                continue
            collected[rank] = (ok, payload)
            if len(collected) + len(expect_missing) == world and all(r in collected for r in range(world)
                                                                     if r not in expect_missing):
                break
    finally:
        for rank, process in enumerate(processes):
            process.join(timeout=max(0.0, min(5.0, end - time.monotonic())))
            if process.is_alive():
                killed.add(rank)
                process.kill()  # only the processes this harness started, by their own handle
                process.join()
    deaths = {}
    for rank, process in enumerate(processes):
        if rank not in collected:
            code = process.exitcode
            if rank in killed:
                how = "still running at the deadline (hang): killed by the harness"
            elif code is not None and code < 0:
                how = f"{CRASHED} {-code}"
            else:
                how = f"exit code {code}"
            with open(crash_logs[rank]) as log:
                stacks = log.read().strip()
            deaths[rank] = how + (f"; fault handler:\n{stacks}" if stacks else "")
    logs.cleanup()
    return collected, deaths
