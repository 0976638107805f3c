"""The torchrun environment: initialise the process group and pick this rank's device.

``torchrun`` (and ``torch.multiprocessing`` launchers that set the same
variables) tell each process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. From them :func:`init_from_env` chooses
NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, gloo and the CPU
otherwise, and sets a process-group timeout short enough that a rank which
hangs ends the job in bounded time (PyTorch's default is 30 minutes).

A gloo group it creates is destroyed at exit, while the interpreter is still
whole (:func:`_close_at_exit`), unless the script destroyed it first.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from pipe.distributed.mesh import forget_reused

__all__: list[str] = []

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedEnv:
    """What :func:`init_from_env` set up for this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_from_env(
    backend: Optional[str] = None,
    *,
    timeout: Union[float, datetime.timedelta, None] = None,
    cpu_threads: Optional[int] = None,
) -> DistributedEnv:
    """Initialises ``torch.distributed`` from the torchrun environment variables.

    Usage (``torchrun --nproc-per-node=2 train.py``)::

        env = pipe.distributed.init_from_env()
        model = pipe.distributed.DistributedPipe(layers, chunks=8)

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available, else gloo. Under gloo the
            returned device is the CPU; ranks that share GPUs over gloo pass ``device=`` to ``DistributedPipe``.
        timeout: how long a collective or point-to-point wait may block before
            the job fails, in seconds (a number) or a ``datetime.timedelta``;
            default :data:`DEFAULT_TIMEOUT` (60 s).
        cpu_threads: intra-op threads of this process (e.g. 1 when several
            ranks share a machine's cores); default: leave PyTorch's setting.

    Returns:
        The rank, world size, local rank, device and backend. If the process
        group is already initialised, it is described, not re-created.

    Raises:
        RuntimeError: a torchrun variable is missing; the message names it.
        TypeError, ValueError: ``timeout`` is not a positive number of seconds or timedelta.
    """
    wait = as_timedelta(timeout)
    missing = [name for name in _REQUIRED if name not in os.environ]
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"environment variables {', '.join(missing)} are not set; start the script with torchrun "
            "(e.g. torchrun --nproc-per-node=2 script.py, see launch/README.md) or set them yourself"
        )
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK is {local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s): NCCL "
                "needs one GPU per process. Start at most that many processes per node (torchrun "
                f"--nproc-per-node={max(torch.cuda.device_count(), 1)}), or pass backend='gloo' here and "
                "device=torch.device('cuda', LOCAL_RANK % torch.cuda.device_count()) to DistributedPipe to share "
                "GPUs between ranks (gloo moves each message through host memory; slower)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        _check_restartable()
        dist.init_process_group(backend, timeout=wait)
        if backend == "gloo":
            atexit.unregister(_close_at_exit)  # once, however many groups the process makes in turn
            atexit.register(_close_at_exit)
    env = DistributedEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())
    logger.info("rank %d of %d (local rank %d) on %s with %s", env.rank, env.world_size, local_rank, device, env.backend)
    return env


SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
"""What a job launched with ``torchrun --max-restarts`` needs in its environment to restart (pytorch/pytorch#135712)."""


def _check_restartable() -> None:
    """Refuses a restarted torchrun attempt whose process group cannot form, before it fails or hangs.

    By default torchrun's c10d rendezvous shares its TCP store with the
    workers (``TORCHELASTIC_USE_AGENT_STORE=True``), and the store outlives
    an attempt with its keys unprefixed: after a restart, ``init_process_group``
    reads the previous attempt's addresses (gloo: "connectFullMesh failed ...
    Connection refused") or counters (it waits until the timeout)
    (pytorch/pytorch#135712, seen with torch 2.13). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every attempt gets a store of its
    own (``launch/single_node.sh`` and ``launch/multi_node.sh`` set it).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0")
    if attempt > 0:
        raise RuntimeError(
            f"torchrun restarted this job (TORCHELASTIC_RESTART_COUNT={attempt}) with the rendezvous store "
            "shared with the workers, which still holds the first attempt's process-group keys: the process "
            "group cannot form (pytorch/pytorch#135712). Launch with "
            f"{SHARED_STORE_FIX} in the environment (launch/single_node.sh sets it)"
        )
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or "0")
    if restarts > 0 and os.environ.get("RANK") == "0":
        logger.warning(
            "torchrun --max-restarts %d without %s: a restart would fail to form the process group (the rendezvous "
            "store, shared with the workers, keeps this attempt's keys; pytorch/pytorch#135712): set it in the "
            "environment", restarts, SHARED_STORE_FIX)


def _close_at_exit() -> None:
    """Destroys the gloo process group and every group pipe keeps, before the interpreter's finalization.

    A gloo worker thread lets go of a finished collective's tensors a moment
    after the caller's wait returns. When that thread's reference is a tensor's
    last, it takes the interpreter lock to free the Python object; during the
    interpreter's finalization that ends the thread inside a destructor, and the
    process aborts ("terminate called without an active exception") after its
    work is done: the last collectives before exit (a checkpoint's, say) left
    to the finalization, seen about once in 100 launches on a loaded machine.
    Destroying the groups here joins their threads while the lock can still be
    taken (torch's group objects let go of the lock as they are destroyed).
    Groups that other objects still hold (torch's redistribution cache keeps
    tensor-parallel meshes) are left alone; their last work ended earlier.
    Nothing to do if the script destroyed the group itself.
    """
    if not dist.is_initialized():
        return
    try:
        forget_reused()
        dist.destroy_process_group()
        gc.collect()  # groups held only by cycles (a pipeline's) are destroyed now, not in finalization
    except Exception as error:  # at exit: the reason is logged, the exit goes on
        logger.warning("could not destroy the process group at exit (%s: %s)", type(error).__name__, error)


def as_timedelta(timeout: Union[float, datetime.timedelta, None]) -> datetime.timedelta:
    """``timeout`` (seconds, a timedelta, or None for :data:`DEFAULT_TIMEOUT`) as a timedelta.

    Raises:
        TypeError: not a number or a timedelta.
        ValueError: not positive and finite.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be a number of seconds or a datetime.timedelta, got {type(timeout).__name__} "
            f"{timeout!r}; e.g. timeout=60 or timeout=datetime.timedelta(minutes=1)"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}; e.g. timeout=60")
    return datetime.timedelta(seconds=seconds)


def rank_device(device: Optional[torch.device]) -> torch.device:
    """Where this rank's layers live: ``device``, else the current CUDA device under NCCL, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device, as tensors put there say
        return torch.device("cuda", torch.cuda.current_device())
    return device
