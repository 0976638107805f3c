"""One fault on rank 2 of 4 gloo ranks, on a mesh: what every survivor names, and when it ends.

Used by ``test_fault_matrix.py`` two ways: :func:`run` on ranks started by
``spawn_ranks.run_ranks`` (the store in rank 0), and as a script under
``torchrun`` (the store in the agent): ``python fault_ranks.py LAYOUT HOW TIMEOUT``.

Layouts (rank 2 and its partners):

    fsdp      make_mesh(pp=2, dp_shard=2): rank 2 is stage 1, shard partner of rank 3
    hsdp      make_mesh(pp=1, dp_replicate=2, dp_shard=2): shard partner of 3, replica of 0
    tp        make_mesh(pp=2, tp=2) with a tensor-parallel plan: rank 2 is stage 1, tp partner of 3
    replicas  a mesh ("pp", "dp_replicate") with each pipeline on consecutive ranks, {0, 1} and {2, 3}:
              rank 2 is stage 0 of pipeline 1, replica of rank 0

Faults, in the forward of a layer of rank 2 at step 2 (the third): ``exit``
(``os._exit``), ``kill`` (SIGKILL), ``raise`` (ValueError) or ``stall`` (sleeps
:data:`STALL` seconds, far past the timeout); or ``pause``: rank 2 sleeps as
long before step 2, between steps, while the others begin it. Or in a save
(:data:`SAVES`): ``dcp-exit``, ``dcp-kill`` (rank 2 ends once it wrote its
files in ``pipe.distributed.state.save`` of step 2, after a complete save of
step 1), ``async-exit``, ``async-kill`` (the same, in the background write of
``state.save(..., asynchronous=True)``, which ``state.wait()`` then waits for)
and ``hf-exit``, ``hf-kill`` (in ``pipe.distributed.hf.save``, as it
opens the files to write its tensors). Each survivor reports ``(message,
seconds from the start of step 2, or of the failed save, to its error,
what the checkpoint folder holds after it)``; under torchrun the agent may
end a survivor first (it ends every rank once one's process ended), after it
logged its headline.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import pipe.distributed as pd
import pipe.distributed.hf  # noqa: F401 - pd.hf
import pipe.distributed.state  # noqa: F401 - pd.state

WIDTH, ROWS = 8, 8
VICTIM, AT_STEP = 2, 2
STALL = 60.0
LAYOUTS = ("fsdp", "hsdp", "tp", "replicas")
FAULTS = ("exit", "kill", "raise", "stall")
SAVES = ("dcp-exit", "dcp-kill", "async-exit", "async-kill", "hf-exit", "hf-kill")


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Fault(nn.Module):
    """Does ``how`` on rank :data:`VICTIM` when ``armed`` (set by the driver at step :data:`AT_STEP`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.mix = Mix()
        self.how = how
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and dist.get_rank() == VICTIM:
            self.armed = False
            if self.how == "exit":
                os._exit(3)
            elif self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "raise":
                raise ValueError("boom on rank 2")
            elif self.how == "stall":
                time.sleep(STALL)
        return self.mix(x)


def _pipe(layout: str, how: str) -> pd.DistributedPipe:
    torch.manual_seed(0)
    model = nn.Sequential(Mix(), Mix(), Fault(how), Mix())  # the fault is in stage 1 (pp 2), or anywhere (pp 1)
    if layout == "fsdp":
        return pd.DistributedPipe(model, chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2))
    if layout == "hsdp":
        return pd.DistributedPipe(model, chunks=2, mesh=pd.make_mesh(pp=1, dp_replicate=2, dp_shard=2))
    if layout == "tp":
        plan = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
        return pd.DistributedPipe(model, chunks=2, mesh=pd.make_mesh(pp=2, tp=2), tensor_parallel=plan)
    # replicas: pipelines {0, 1} and {2, 3}; rank 2 runs stage 0, where the fault goes
    model = nn.Sequential(Fault(how), Mix(), Mix(), Mix())
    consecutive = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).t(), mesh_dim_names=("pp", "dp_replicate"))
    return pd.DistributedPipe(model, chunks=2, mesh=consecutive)


def _die(how: str) -> None:
    """Ends this process as ``how`` says (``...exit``: ``os._exit(3)``; ``...kill``: SIGKILL)."""
    if how.endswith("exit"):
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_save_fault(how: str) -> None:
    """Makes rank :data:`VICTIM` die in its next save of the kind ``how`` names (``dcp-``, ``async-``, ``hf-...``)."""
    if dist.get_rank() != VICTIM:
        return
    if how.startswith(("dcp", "async")):  # an asynchronous save's write runs in DCP's thread: it dies there
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def writes_then_dies(self: FileSystemWriter, plan: object, planner: object) -> object:
            written = write_data(self, plan, planner)  # type: ignore[arg-type]
            if hasattr(written, "wait"):
                written.wait()
            _die(how)  # its files are written; the metadata (rank 0's, last) is not
            return written

        FileSystemWriter.write_data = writes_then_dies  # type: ignore[method-assign]
    else:
        from pipe.distributed import safetensors_files

        create = safetensors_files.create

        def dies_opening(*args: object, **kwargs: object) -> object:
            if kwargs.get("write") is False:  # every rank opens the files rank 0 made, to write its tensors
                _die(how)
            return create(*args, **kwargs)  # type: ignore[arg-type]

        safetensors_files.create = dies_opening  # type: ignore[assignment]


def _save(how: str, path: str, piped: pd.DistributedPipe) -> None:
    if how.startswith("dcp"):
        pd.state.save(path, piped)
    elif how.startswith("async"):
        pd.state.save(path, piped, asynchronous=True)
        pd.state.wait()
    else:
        pd.hf.save(path, piped)


BEFORE = "before the fault, in step"  # what a rank's report starts with when it failed before the faulty step


def run(rank: int, world: int, layout: str, how: str, wait_for_others: bool = True,
        folder: str = "") -> tuple[str, float, str]:
    """Trains until the fault; returns ``(this rank's error, seconds from the start of step 2 (or of the failed
    save) to it, what the checkpoint folder holds after it)``. The checkpoints of a save fault go to ``folder``
    (default ``$FAULT_REPORTS/checkpoints``).

    Under torchrun (``FAULT_REPORTS`` set) also writes them, with the step's start, to ``$FAULT_REPORTS/<rank>.json``.
    """
    piped = _pipe(layout, how)
    x, y = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)), torch.zeros(ROWS, WIDTH)
    fault = next((m for m in piped.modules() if isinstance(m, Fault)), None)
    saves = how in SAVES
    folder = folder or os.path.join(os.environ.get("FAULT_REPORTS", "."), "checkpoints")
    start = time.monotonic()
    message = "no error"
    for step in range(AT_STEP + 2):
        if step == AT_STEP:
            start = time.monotonic()
            if os.environ.get("FAULT_REPORTS"):  # under torchrun: when the faulty step started, for the job's time
                with open(os.path.join(os.environ["FAULT_REPORTS"], f"began{rank}"), "w") as began:
                    began.write(repr(time.time()))
            if fault is not None and not saves:
                fault.armed = True
            if how == "pause" and rank == VICTIM:  # stalls between steps: the others begin the step without it
                time.sleep(STALL)
        try:
            piped.step(x, y, F.mse_loss)
            if saves and step in (AT_STEP - 1, AT_STEP):  # a complete save, then one that rank 2 does not finish
                if step == AT_STEP:
                    _arm_save_fault(how)
                    start = time.monotonic()
                _save(how, str(pd.state.step_path(folder, step)), piped)
        except Exception as error:  # the victim's own ValueError, or a survivor's PipelineFailure
            message = f"{type(error).__name__}: {error}"
            if step < AT_STEP:  # the launch never reached the fault (a connection that the machine's load kept
                message = f"{BEFORE} {step}: {message}"  # past the short timeout, say): the tests start it again
            break
    seconds = time.monotonic() - start
    kept = ""
    if saves:  # what a restart finds: the newest complete checkpoint, and whether the interrupted one counts
        newest = pd.state.latest(folder)  # DCP's (an export has no .metadata)
        interrupted = pd.state.step_path(folder, AT_STEP)
        kept = (f"latest {newest.name if newest else None}; complete {pd.state.is_complete(interrupted)}; "
                f"folders {' '.join(sorted(os.listdir(folder)))}")
    if os.environ.get("FAULT_REPORTS"):
        with open(os.path.join(os.environ["FAULT_REPORTS"], f"{rank}.json"), "w") as report:
            json.dump({"rank": rank, "message": message, "seconds": seconds, "kept": kept}, report)
    if wait_for_others:  # ranks started by run_ranks: rank 0 hosts the store, so it waits for the other verdicts
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test/verdict/{rank}", "done")
        if rank == 0:
            survivors = [f"test/verdict/{r}" for r in range(1, world) if r != VICTIM]
            try:
                store.wait(survivors, datetime.timedelta(seconds=30))
            except Exception:
                pass
    return message, seconds, kept


def headline(message: str) -> str:
    """The root cause in a survivor's message: what follows ``because``, without the local detail."""
    if " because " not in message:
        return message
    return message.split(" because ", 1)[1].rsplit(" (here: ", 1)[0]


def _all_started(folder: str, world: int, limit: float = 240.0) -> None:
    """Waits (up to ``limit`` seconds) until every rank of the job has imported what it needs and called this.

    Under torchrun the ranks connect within the job's timeout (the test's ``timeout(how)``: 4 s for a stall),
    which must stay short for a stalled rank to be named fast; on a loaded machine one rank's imports can take longer
    than that behind another's, and the connect then fails before any fault. Each rank marks itself in
    ``folder/started`` (a folder: the test reads only the files of ``folder``) and connects once all have.
    """
    marks = os.path.join(folder, "started")
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + limit
    while len(os.listdir(marks)) < world and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    layout, how, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if os.environ.get("FAULT_REPORTS"):
        _all_started(os.environ["FAULT_REPORTS"], int(os.environ["WORLD_SIZE"]))
    pd.init_from_env("gloo", timeout=timeout, cpu_threads=1)
    rank = dist.get_rank()
    message, _, _ = run(rank, dist.get_world_size(), layout, how, wait_for_others=False)
    if message != "no error":
        raise SystemExit(1)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
