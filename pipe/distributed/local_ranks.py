"""Local gloo ranks on 127.0.0.1: ``fn(rank, world, *args)`` on ``world`` processes, with a deadline.

The one way pipe starts local ranks from Python: the planner's measurements
(:func:`pipe.plan.measure.run_plans`), the tests and the benchmarks. Each rank
gets the torchrun variables (``MASTER_ADDR=127.0.0.1``, a free port, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), one intra-op thread, and a gloo process group
(:func:`pipe.distributed.init_from_env`) before ``fn`` runs. A rank that fails
is reported by rank with its traceback, the failed assertion (the cause)
before its partners' knock-on errors; a rank that dies in C++ leaves its
stacks (fault handler); past ``deadline`` every rank still running is killed.

How the ranks start (``start_method``):

* ``"fork"`` (default where no GPU is visible): cheapest, any function works;
* ``"interpreter"`` (default where a GPU is visible): each rank is a fresh
  ``python -m pipe.distributed.local_ranks``, given ``fn`` and ``args`` by
  pickling (``fn`` at module level of an importable module). Unlike
  ``multiprocessing``'s spawn and fork server, whose children run the caller's
  ``__main__`` again (a user's script without ``if __name__ == "__main__":``
  would run once more in each rank), it imports nothing of the caller's but
  ``fn``'s module; and unlike a fork it works after this process used CUDA or
  autograd (a forked child cannot);
* ``"forkserver"``, ``"spawn"``: ``multiprocessing``'s
  (:func:`pipe.distributed.local_ranks.rank_processes`), for callers whose
  ``__main__`` is safe to import again (a test runner).
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Collection, Optional

import torch
import torch.distributed as dist

from pipe.distributed.env import init_from_env

__all__: list[str] = []

CRASHED = "killed by signal"
START_METHODS = ("fork", "interpreter", "forkserver", "spawn")


def rank_processes(method: Optional[str] = None) -> Any:
    """The ``multiprocessing`` context that starts local ranks from Python (the planner's, the tests').

    Default: fork where no GPU is visible (cheapest; any function works). Where one is, a fork server: a
    fresh interpreter that imports torch and pipe once and forks each rank. A child forked from a process
    can use neither CUDA once that process has, nor autograd once it ran a backward (in a CUDA build with a
    GPU, the first backward starts autograd's device threads, and torch then refuses a forked child's), and a
    spawn re-imports torch for every rank. The fork server's ranks get their function and arguments by
    pickling. ``method`` (``"fork"``, ``"forkserver"``, ``"spawn"``) chooses another.
    """
    method = method or ("forkserver" if torch.cuda.is_available() else "fork")
    context: Any = multiprocessing.get_context(method)
    if method == "forkserver":  # imported once in the server, before it forks the ranks
        context.set_forkserver_preload(["torch", "torch.distributed", "pipe", "pipe.distributed"])
    return context


class RankFailure(RuntimeError):
    """Local ranks failed: the message has each failed rank's traceback (the cause first) and how each rank
    that returned nothing ended. ``failed`` and ``missing`` name the ranks; ``ended`` says how each missing
    rank ended (``"killed by signal 11; ..."``, ``"exit code 1"``, ``"still running at the deadline ..."``)."""

    def __init__(self, message: str, failed: list[int], missing: list[int], ended: dict[int, str]) -> None:
        super().__init__(message)
        self.failed, self.missing, self.ended = failed, missing, ended


def free_port() -> int:
    """A port free on 127.0.0.1 now (another process may take it before it is bound: callers retry)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_start_method() -> str:
    """``"fork"`` where no GPU is visible, else ``"interpreter"`` (a forked child cannot use CUDA)."""
    return "interpreter" if torch.cuda.is_available() else "fork"


def run_local_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 20.0, deadline: float = 90.0,
                    env: Optional[dict[str, str]] = None, barrier: bool = True, expect_missing: Collection[int] = (),
                    start_method: Optional[str] = None, init: bool = True) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` local gloo ranks; returns each rank's result, by rank.

    Args:
        timeout: each rank's process-group timeout (seconds).
        deadline: the whole run's limit; past it the ranks still running are killed and reported.
        env: more environment variables for the ranks: a fresh interpreter's (``"interpreter"``) from its start,
            for what torch reads as it loads; the other start methods' set before ``fn`` runs.
        barrier: wait for every rank before a rank exits (off when ranks are meant to fail).
        expect_missing: ranks meant to end without returning (their result is None).
        start_method: ``"fork"``, ``"interpreter"``, ``"forkserver"`` or ``"spawn"`` (module docstring);
            default :func:`default_start_method`.
        init: make the gloo group before ``fn`` (with ``timeout``); False: ``fn`` makes it itself from the
            torchrun variables (a benchmark that times its own setup), and ``barrier`` is not waited for.

    Raises:
        RankFailure: a rank raised, crashed or outran ``deadline``; the message names each rank.
        ValueError: an unknown ``start_method``.
    """
    method = start_method or default_start_method()
    if method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {method!r}")
    for _ in range(3):  # a port found free may be taken before rank 0's store binds it: start again on another
        collected, deaths = _start(fn, world, args, timeout if init else None, deadline, env or {},
                                   barrier and init, expect_missing, method)
        if not any(not ok and "EADDRINUSE" in str(payload) for ok, payload in collected.values()):
            break
    ordered = _cause_first(collected)
    failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in ordered if not ok]
    missing = [rank for rank in range(world) if rank not in collected and rank not in expect_missing]
    if failures or missing:
        raise RankFailure("\n".join(failures) + (f"\nranks {missing} returned nothing (hang or crash)"
                                                  if missing else "")
                          + "".join(f"\nrank {rank}: {deaths[rank]}" for rank in missing if rank in deaths),
                          [rank for rank, (ok, _) in ordered if not ok], missing,
                          {rank: deaths[rank] for rank in missing if rank in deaths})
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
    return sorted(collected.items(), key=lambda item: not cause(item))  # stable: the order of arrival otherwise


def _rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: Optional[float],
          env: dict[str, str], barrier: bool, crash_log: str, put: Callable[[tuple[int, bool, Any]], None]) -> None:
    """One rank: the torchrun variables, one thread and gloo (unless ``timeout`` is None: ``fn`` sets up its
    threads and joins itself), ``fn``; ``put`` gets ``(rank, ok, result or traceback)``."""
    faulthandler.enable(open(crash_log, "w"), all_threads=True)  # a rank that dies in C++ leaves its stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), **env)
    try:
        if timeout is not None:  # else fn sets up its process, and its threads, itself
            torch.set_num_threads(1)
            init_from_env("gloo", timeout=timeout)  # seconds
        result = fn(rank, world, *args)
        if barrier:
            dist.barrier()  # keep the store (hosted by rank 0) alive until every rank is done
        put((rank, True, result))
    except BaseException:
        put((rank, False, traceback.format_exc()))


def _queued_rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
                 timeout: Optional[float], env: dict[str, str], barrier: bool, crash_log: str,
                 results: "multiprocessing.Queue[Any]") -> None:
    _rank(rank, world, port, fn, args, timeout, env, barrier, crash_log, results.put)


class _Interpreter:
    """A rank in a fresh interpreter (``python -m pipe.distributed.local_ranks JOB RANK``): its result is the
    pickle file ``JOB.RANK`` (written whole: renamed into place). ``env`` is in its environment from the start,
    for what torch reads as it loads (``THP_MEM_ALLOC_ENABLE``, ``CUDA_VISIBLE_DEVICES``)."""

    def __init__(self, job: str, rank: int, log: str, env: dict[str, str]) -> None:
        self.out = f"{job}.{rank}"
        path = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))])
        with open(log, "a") as printed:  # PYTHONPATH: fn's module
            self.process = subprocess.Popen([sys.executable, "-m", "pipe.distributed.local_ranks", job, str(rank)],
                                            stdin=subprocess.DEVNULL, stdout=printed, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, **env, PYTHONPATH=path))
        self.log = log

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def result(self) -> Optional[tuple[int, bool, Any]]:
        if not os.path.exists(self.out):
            return None
        with open(self.out, "rb") as file:
            found: tuple[int, bool, Any] = pickle.load(file)
        return found

    def join(self, timeout: float) -> None:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.process.kill()  # only the process this module started, by its own handle
        self.process.wait()

    @property
    def exitcode(self) -> Optional[int]:
        return self.process.returncode


def _start(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: Optional[float], deadline: float,
           env: dict[str, str], barrier: bool, expect_missing: Collection[int], method: str
           ) -> tuple[dict[int, tuple[bool, Any]], dict[int, str]]:
    """One start of ``world`` ranks on a free port: each rank's (ok, result or traceback) that came back, and
    for each rank that ended without one, how it ended (exit code, signal, or killed at the deadline) and the
    stacks Python's fault handler wrote."""
    port = free_port()
    logs = tempfile.TemporaryDirectory(prefix="pipe-ranks-")
    faults = [os.path.join(logs.name, f"rank{rank}.faults") for rank in range(world)]  # the fault handler's
    printed = [os.path.join(logs.name, f"rank{rank}.txt") for rank in range(world)]  # a fresh interpreter's output
    results: Any = None
    if method == "interpreter":
        job = os.path.join(logs.name, "job")
        with open(job, "wb") as file:
            pickle.dump((fn, world, port, args, timeout, env, barrier), file)
        processes: list[Any] = [_Interpreter(job, rank, printed[rank], env) for rank in range(world)]
    else:
        context = rank_processes(method)
        results = context.Queue()
        processes = [context.Process(target=_queued_rank, name=f"pipe-rank-{rank}", daemon=True, args=(
            rank, world, port, fn, args, timeout, env, barrier, faults[rank], results)) for rank in range(world)]
        for process in processes:
            process.start()
    collected: dict[int, tuple[bool, Any]] = {}
    killed: set[int] = set()
    end = time.monotonic() + deadline
    wanted = [r for r in range(world) if r not in expect_missing]
    try:
        while len(collected) < world and time.monotonic() < end:
            if results is not None:
                try:
                    rank, ok, payload = results.get(timeout=min(max(end - time.monotonic(), 0.0), 1.0))
                    collected[rank] = (ok, payload)
                except queue.Empty:
                    if all(not p.is_alive() for p in processes) and results.empty():
                        break
            else:
                for rank, process in enumerate(processes):
                    found = process.result() if rank not in collected else None
                    if found is not None:
                        collected[rank] = (found[1], found[2])
                if all(not p.is_alive() for p in processes):
                    for rank, process in enumerate(processes):  # written just before the process ended
                        found = process.result() if rank not in collected else None
                        if found is not None:
                            collected[rank] = (found[1], found[2])
                    break
                time.sleep(0.05)
            if all(r in collected for r in wanted):
                break
    finally:
        for rank, process in enumerate(processes):
            process.join(timeout=max(0.0, min(5.0, end - time.monotonic())))
            if process.is_alive():
                killed.add(rank)
                process.kill()
                process.join(timeout=5.0)
    deaths = {}
    for rank, process in enumerate(processes):
        if rank not in collected:
            code = process.exitcode
            how = ("still running at the deadline (hang): killed" if rank in killed
                   else f"{CRASHED} {-code}" if code is not None and code < 0 else f"exit code {code}")
            stacks = (_read(faults[rank]) + "\n" + _read(printed[rank])[-4000:]).strip()  # a fresh interpreter's output
            deaths[rank] = how + (f"; fault handler:\n{stacks}" if stacks else "")
    logs.cleanup()
    return collected, deaths


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as file:
        return file.read()


def _main(job: str, rank: int) -> None:
    """A rank started as ``python -m pipe.distributed.local_ranks JOB RANK``."""
    with open(job, "rb") as file:
        fn, world, port, args, timeout, env, barrier = pickle.load(file)
    out = f"{job}.{rank}"

    def put(result: tuple[int, bool, Any]) -> None:
        try:
            data = pickle.dumps(result)
        except Exception as error:  # a result that does not pickle is this rank's failure, said so
            data = pickle.dumps((rank, False, f"the result of rank {rank} does not pickle: {error}"))
        with open(out + ".tmp", "wb") as file:
            file.write(data)
        os.replace(out + ".tmp", out)  # whole or absent

    _rank(rank, world, port, fn, args, timeout, env, barrier, os.path.join(os.path.dirname(job), f"rank{rank}.faults"),
          put)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
