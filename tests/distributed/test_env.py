"""init_from_env and the launch/ scripts: two torchrun "nodes" on 127.0.0.1 train the example."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipe.distributed import init_from_env
from spawn_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_init_from_env_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set; start the script with torchrun"):
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
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    nodes = [(["bash", "launch/multi_node.sh", *example], dict(env, NODE_RANK=str(i))) for i in range(2)]
    results = _run(nodes, timeout=180)
    for code, out in results:
        assert code == 0, out[-3000:]
    assert any("done: 3 steps" in out for _, out in results), results[0][1][-3000:]
    assert (tmp_path / "ckpt" / ".metadata").exists()
