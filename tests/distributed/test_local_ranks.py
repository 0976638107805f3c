"""pipe.distributed.local_ranks: the one way to start local gloo ranks (library, tests, benchmarks)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipe.distributed.local_ranks import RankFailure, run_local_ranks


def _ranks_and_sum(rank: int, world: int, offset: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return rank + offset, world, float(value)


def _rank_1_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise AssertionError("rank 1's own check")
    return rank


def _joins_itself(rank: int, world: int) -> tuple[bool, int]:
    import torch.distributed as dist

    joined_before = dist.is_initialized()
    dist.init_process_group("gloo")  # from the torchrun variables the rank was given
    size = dist.get_world_size()
    dist.destroy_process_group()
    return joined_before, size


def test_a_rank_function_may_join_the_group_itself() -> None:
    """init=False: the benchmarks' rank functions make their group with their own timeouts."""
    assert run_local_ranks(_joins_itself, 2, init=False, deadline=60) == [(False, 2), (False, 2)]


@pytest.mark.parametrize("start_method", ["fork", "interpreter"])
def test_ranks_run_with_a_process_group_and_return_by_rank(start_method: str) -> None:
    assert run_local_ranks(_ranks_and_sum, 2, 10, start_method=start_method, deadline=120) == [
        (10, 2, 1.0), (11, 2, 1.0)]


def _environment_at_start(rank: int, world: int) -> tuple[str, str]:
    """The process's environment as it started (before torch was imported), and as it is now."""
    import os

    with open("/proc/self/environ", "rb") as file:
        start = dict(entry.split(b"=", 1) for entry in file.read().split(b"\0") if b"=" in entry)
    return start.get(b"PIPE_TEST_SETTING", b"").decode(), os.environ.get("PIPE_TEST_SETTING", "")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment in /proc")
def test_a_fresh_interpreter_has_env_from_its_start() -> None:
    """What torch reads as it loads (THP_MEM_ALLOC_ENABLE) must be in the rank's environment before it starts;
    a forked rank gets it set before fn only."""
    started = run_local_ranks(_environment_at_start, 2, env={"PIPE_TEST_SETTING": "1"}, start_method="interpreter",
                              deadline=120)
    assert started == [("1", "1"), ("1", "1")]
    assert run_local_ranks(_environment_at_start, 1, env={"PIPE_TEST_SETTING": "1"}, start_method="fork",
                           deadline=60) == [("", "1")]


def test_a_failed_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(RankFailure) as error:
        run_local_ranks(_rank_1_fails, 2, barrier=False, deadline=60)
    assert error.value.failed == [1] and error.value.missing == []
    assert str(error.value).startswith("rank 1:\nTraceback") and "AssertionError: rank 1's own check" in str(error.value)
    with pytest.raises(ValueError, match="start_method must be one of fork, interpreter, forkserver, spawn, got 'thread'"):
        run_local_ranks(_rank_1_fails, 2, start_method="thread")


def test_fresh_interpreters_do_not_run_the_callers_script_again(tmp_path: Path) -> None:
    """A user's script without ``if __name__ == "__main__":`` runs once: the ranks import only fn's module
    (multiprocessing's spawn and fork server would run the script again in every rank, issue 41 item 7)."""
    (tmp_path / "rank_work.py").write_text("def work(rank, world):\n    return rank * 10\n")
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        print("the script ran", flush=True)
        from pipe.distributed.local_ranks import run_local_ranks
        from rank_work import work
        print(run_local_ranks(work, 2, start_method="interpreter", deadline=120), flush=True)
    """))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("the script ran") == 1, done.stdout
    assert "[0, 10]" in done.stdout, done.stdout
