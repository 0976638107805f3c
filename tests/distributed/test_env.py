"""init_from_env and the launch/ scripts: two torchrun "nodes" on 127.0.0.1 train the example."""
from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipe.distributed import init_from_env
from pipe.distributed.env import DEFAULT_TIMEOUT, as_timedelta
from pipe.distributed.group import world_timeout
from spawn_ranks import free_port, run_ranks
from torchrun_launch import aborted_at_exit

ROOT = Path(__file__).resolve().parents[2]


def test_init_from_env_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set; start the script with torchrun"):
        init_from_env()


def test_more_local_ranks_than_gpus_under_nccl_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is 1 but this machine has 1 CUDA device\(s\).*"
                                           r"--nproc-per-node=1\), or pass backend='gloo'"):
        init_from_env()


def _run(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[tuple[int, str]]:
    """Starts every command in its own session; kills those still running at the deadline (by their group id)."""
    processes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True) for command, env in commands]
    results = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            results.append((process.returncode, out))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the session this test started, and only it
                process.wait()
    return results


@pytest.mark.slow
def test_two_nodes_on_localhost_train_the_example(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    example = ["examples/transformer_lm_distributed.py", "--steps", "3", "--layers", "2", "--width", "32",
               "--seq-len", "16", "--batch-size", "8", "--eval-batches", "1", "--save", str(tmp_path / "ckpt")]
    env = dict(os.environ, MASTER=master, NNODES="2", NPROC="1", THREADS="1", JOB_ID=f"test{os.getpid()}",
               CUDA_VISIBLE_DEVICES="",  # the CPU path, as on CI: two "nodes" on one GPU would share it
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    nodes = [(["bash", "launch/multi_node.sh", *example], dict(env, NODE_RANK=str(i))) for i in range(2)]
    results = _run(nodes, timeout=180)
    everything = "\n".join(out for _, out in results)  # rank 0 prints "done"; either node may abort at exit
    if aborted_at_exit(max(abs(code) for code, _ in results), everything, "done: 3 steps"):  # once more
        master = f"127.0.0.1:{free_port()}"
        nodes = [(command, dict(node_env, MASTER=master)) for command, node_env in nodes]
        results = _run(nodes, timeout=180)
    for code, out in results:
        assert code == 0, out[-3000:]
    assert any("done: 3 steps" in out for _, out in results), results[0][1][-3000:]
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_timeout_in_seconds_or_timedelta() -> None:
    # The docs speak in seconds: init_from_env(timeout=5) means five seconds, as timedelta(seconds=5) does.
    assert as_timedelta(5) == datetime.timedelta(seconds=5)
    assert as_timedelta(2.5) == datetime.timedelta(seconds=2.5)
    assert as_timedelta(datetime.timedelta(minutes=1)) == datetime.timedelta(seconds=60)
    assert as_timedelta(None) == DEFAULT_TIMEOUT
    for bad, error, message in ((0, ValueError, "positive, finite number of seconds, got 0"),
                                (float("inf"), ValueError, "got inf"),
                                (datetime.timedelta(0), ValueError, "got datetime.timedelta"),
                                ("5", TypeError, "number of seconds or a datetime.timedelta, got str '5'"),
                                (True, TypeError, "got bool True")):
        with pytest.raises(error, match=re.escape(message)):
            as_timedelta(bad)


def _world_timeout_seconds(_rank: int, _world: int) -> float:
    return world_timeout().total_seconds()


def test_init_from_env_with_a_timeout_in_seconds_sets_the_process_group_timeout() -> None:
    # One rank (world 1): the process group gets 5 s, and so does every group the pipeline makes.
    assert run_ranks(_world_timeout_seconds, 1, timeout=5) == [5.0]


def test_local_ranks_come_from_a_fork_server_where_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipe.distributed.local_ranks import rank_processes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_processes().get_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # forking would inherit CUDA and autograd state
    assert rank_processes().get_start_method() == "forkserver"
    assert rank_processes("spawn").get_start_method() == "spawn"


_EXITING = """
import atexit, sys
import torch
import torch.distributed as dist
import pipe.distributed as pd

# Registered first, so it runs after pipe's own exit handler.
atexit.register(lambda: print("initialised at exit:", dist.is_initialized(), flush=True))
pd.init_from_env()
pipeline = pd.DistributedPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), chunks=2)
pipeline.step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss)
if sys.argv[1] == "destroys":
    dist.destroy_process_group()
print("done", flush=True)
"""


@pytest.mark.parametrize("script", ["leaves", "destroys"])
def test_a_gloo_group_from_init_from_env_is_destroyed_before_the_interpreter_finalizes(script: str) -> None:
    # Left to the interpreter's finalization, a gloo thread that frees a collective's tensor aborts the process.
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", _EXITING, script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["done", "initialised at exit: False"], done.stdout
    assert "could not destroy" not in done.stderr


def test_a_restarted_torchrun_attempt_on_the_shared_rendezvous_store_is_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from pipe.distributed import env as env_module

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's default: the store outlives attempts
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(RuntimeError, match=r"torchrun restarted this job \(TORCHELASTIC_RESTART_COUNT=1\) with the "
                                           r"rendezvous store shared .* Launch with "
                                           r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment"):
        env_module._check_restartable()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first attempt: warned, once, on rank 0
    with caplog.at_level("WARNING", logger="pipe.distributed.env"):
        env_module._check_restartable()
    assert [r.getMessage() for r in caplog.records] == [
        "torchrun --max-restarts 3 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restart would fail to form the "
        "process group (the rendezvous store, shared with the workers, keeps this attempt's keys; "
        "pytorch/pytorch#135712): set it in the environment"]
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store of each attempt's own
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    env_module._check_restartable()
    assert not caplog.records


def test_cuda_without_an_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DistributedPipe(device="cuda")``: the stages and the tensors put on "cuda" are on the current device, so
    the pipeline's device says which (found on a GPU: inputs on cuda:0 were refused as not on "cuda")."""
    from pipe.distributed.env import rank_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
