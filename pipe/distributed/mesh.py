"""The topology of a job as a ``DeviceMesh``: pipeline, data-parallel and tensor-parallel dimensions.

``DistributedPipe(model, mesh=...)`` takes torch's own ``DeviceMesh`` whose
dimensions are named as torchtitan names them::

    "pp"            pipeline ranks (required): the stages of one pipeline
    "dp_replicate"  replicas: full copies of each stage, gradients averaged
    "dp_shard"      FSDP2 shards: each stage's parameters, gradients and optimizer
                    state split over these ranks (``fully_shard``); with
                    "dp_replicate" too, HSDP
    "tp"            tensor parallel: a stage's blocks split by ``parallelize_module``

:func:`make_mesh` builds one with ``init_device_mesh`` in that order (the
dimensions of size 1 other than "pp" left out), so ``pp`` is the slowest
varying coordinate and ``tp`` the fastest, as in torchtitan::

    make_mesh(pp=2, dp_shard=2)   ranks 0 1 | 2 3   pipeline rank 0: ranks 0, 1 (a shard group)
                                                     pipeline rank 1: ranks 2, 3

Without a mesh, ``DistributedPipe`` runs one pipeline over the world
(:func:`pipeline_mesh`, ``("pp",)``). Replicas of the pipeline are the mesh's
"dp_replicate" dimension: ``make_mesh(pp=2, dp_replicate=2)`` on 4 ranks puts
stage 0 on ranks 0 and 1 (its replicas average their gradients there, on
consecutive ranks: on one node under torchrun) and stage 1 on ranks 2 and 3;
pipeline 0 is ranks {0, 2}, pipeline 1 ranks {1, 3}. A mesh of another layout
is a ``DeviceMesh`` of your own: ``DeviceMesh("cpu", torch.arange(4).reshape(2,
2).t(), mesh_dim_names=("pp", "dp_replicate"))`` puts each pipeline on
consecutive ranks instead ({0, 1} and {2, 3}).

Process groups (and the meshes that hold them) are created once per process
and shared (:func:`reuse`): each gloo group keeps a connection and three
threads until ``destroy_process_group``, so a group per ``DistributedPipe`` would
leak them in a process that builds many (a planner trying candidates).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import math
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipe.distributed.connections import recording

__all__: list[str] = []

logger = logging.getLogger(__name__)

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")

T = TypeVar("T")
_reused: dict[str, Any] = {"world": None, "objects": {}, "spoiled": False}


def forget_reused() -> None:
    """Drops the reused groups and meshes while the interpreter is still whole (at exit).

    Held here, gloo groups outlive ``destroy_process_group`` and would be
    destroyed during the interpreter's teardown, in no particular order with
    the rest of torch; gloo has been seen to abort a process at exit
    ("terminate called without an active exception"). At exit they go first.
    """
    _reused["world"], _reused["objects"] = None, {}


atexit.register(forget_reused)


def reuse(key: tuple[Any, ...], make: Callable[[], T], kind: str = "pipeline") -> T:
    """The object made for ``key`` in this process, made now (by ``make``) on first use.

    For process groups and meshes: creating one is collective over the world,
    so every rank asks for the same keys in the same order and so gets the same
    answer. Forgotten when the default group is destroyed (a new world starts
    afresh). Two pipelines of a process never communicate at the same time,
    so they can share their groups. The connections ``make`` opens are recorded
    as groups of ``kind`` (:func:`pipe.distributed.connections.recording`).
    """
    world = dist.group.WORLD
    if _reused["world"] is not world:
        _reused["world"], _reused["objects"] = world, {}
    objects: dict[tuple[Any, ...], Any] = _reused["objects"]
    if key not in objects:
        objects[key] = recording(make, kind)
    made: T = objects[key]
    return made


def spoil_reused() -> None:
    """Marks the groups of :func:`reuse` unfit for new pipelines: a step failed on this rank.

    A failed step may have closed a connection (gloo closes a pair whose wait
    timed out) or left messages in flight; the next pipeline must start on
    new groups. Every rank must then make new ones alike: :func:`agree_on_reuse`.
    """
    _reused["spoiled"] = True


def agree_on_reuse(spoiled_anywhere: bool) -> None:
    """Forgets every reused group and mesh if any rank's were spoiled (every rank calls it alike).

    What torch cached for the old meshes is forgotten too (:func:`forget_cached_meshes`): it would put the
    next pipeline's collectives on the spoiled groups.
    """
    if spoiled_anywhere:
        _reused["objects"], _reused["spoiled"] = {}, False
        forget_cached_meshes()


def forget_cached_meshes() -> None:
    """Clears what torch cached for earlier meshes, so that a new mesh's tensors and graphs use its own groups.

    A ``DeviceMesh`` compares equal to, and hashes as, any other mesh of the
    same ranks, shape and dimension names, whatever its process groups. So a
    mesh made after a failed step, with new groups, is taken for the old one:

    - DTensor caches each op's output layout by its inputs' layouts (meshes
      included), in Python and in C++, per thread; a cached layout names the
      old mesh object. ``parallelize_module`` on the new mesh made parameters
      whose ``device_mesh`` was the old one (their ``detach`` hit the cache),
      and every tensor-parallel collective then ran on the old groups.
    - A graph compiled for a stage (``compile=``) names its collectives'
      groups; the new pipeline's stages passed its guards and ran it.

    The old groups' connections were shut down
    (:func:`pipe.distributed.connections.abort`), so the new pipeline's first
    tensor-parallel collective failed ("Connection closed by peer"). Cleared
    here, the layouts are computed and the graphs compiled again for the new
    mesh. DTensor's caches are cleared in the calling thread, which builds and
    steps a pipeline (pipe runs a step's forward and backward there; on the CPU
    the autograd engine runs the backward in the caller's thread).
    ``torch.compiler.reset()`` drops every graph compiled in the process: the
    process's other compiled functions compile again on their next call.
    """
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without DTensor's debug module: no layout cache of ours to clear
        logger.debug("torch.distributed.tensor.debug._clear_sharding_prop_cache not found; DTensor layouts kept")
    else:
        _clear_sharding_prop_cache()
    torch.compiler.reset()


def reuse_spoiled() -> bool:
    """Whether a step failed on this rank since the groups of :func:`reuse` were made."""
    return bool(_reused["spoiled"])


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"make_mesh: {name} must be a positive int (got {value!r}); pass e.g. {name}=1")
    return value


def make_mesh(pp: int, dp_shard: int = 1, dp_replicate: int = 1, tp: int = 1) -> DeviceMesh:
    """A ``DeviceMesh`` over the whole world with the dimensions of :mod:`pipe.distributed.mesh`.

    Dimensions other than "pp" are left out when their size is 1. The device
    type follows the backend (``cuda`` under NCCL, else ``cpu``). Collective:
    every rank must call it.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a size is not a positive int, or the product is not the world size.
    """
    from pipe.distributed.group import require_initialized

    require_initialized()
    sizes = {"pp": _positive("pp", pp), "dp_replicate": _positive("dp_replicate", dp_replicate),
             "dp_shard": _positive("dp_shard", dp_shard), "tp": _positive("tp", tp)}
    world = dist.get_world_size()
    if math.prod(sizes.values()) != world:
        described = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1 or k == "pp")
        raise ValueError(
            f"make_mesh: {described} = {math.prod(sizes.values())} ranks, but the world has {world}; "
            f"choose sizes whose product is {world}"
        )
    names = tuple(k for k in MESH_DIMS if sizes[k] > 1 or k == "pp")
    return recording(lambda: init_device_mesh(_device_type(), tuple(sizes[k] for k in names), mesh_dim_names=names),
                     "pipeline")


def pipeline_mesh() -> DeviceMesh:
    """The mesh of a ``DistributedPipe`` given none: ("pp",) over the world, one pipeline (made once per
    process: :func:`reuse`)."""
    world = dist.get_world_size()
    return reuse(("mesh", "pp"), lambda: DeviceMesh(_device_type(), torch.arange(world), mesh_dim_names=("pp",)))


def mesh_size(mesh: DeviceMesh, name: str) -> int:
    """The size of dimension ``name`` of ``mesh``, 1 if it has none."""
    names = mesh.mesh_dim_names or ()
    return int(mesh.mesh.shape[names.index(name)]) if name in names else 1


def bound_timeouts(mesh: DeviceMesh, timeout: datetime.timedelta) -> None:
    """Gives every process group of ``mesh`` (one per dimension) the job's ``timeout``.

    ``init_device_mesh`` and ``DeviceMesh`` create their groups with torch's
    default (30 minutes on gloo), whatever ``init_process_group(timeout=...)``
    said: a collective of FSDP, HSDP or tensor parallelism waiting for a
    stalled rank would otherwise hold its partners for half an hour. Setting
    it again is harmless (a group shared by two meshes gets the same value).
    """
    for group in mesh.get_all_groups():
        if not dist.distributed_c10d._rank_not_in_group(group):
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def verify_mesh(mesh: object, device: torch.device) -> DeviceMesh:
    """Checks that ``mesh`` can carry a pipeline on this world.

    Args:
        mesh: what the user passed as ``mesh=``.
        device: where this rank's layers live (the mesh's device type must be its type).

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: no "pp" dimension, an unknown or repeated dimension name, a
            mesh that does not cover the world, a device type other than the
            rank's.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            f"build one with pipe.distributed.make_mesh(pp=..., dp_shard=...)"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"the mesh's device type is {mesh.device_type!r} but this rank's layers are on {device} "
            f"(backend {dist.get_backend()}); build the mesh on {device.type!r}, e.g. with "
            f"pipe.distributed.make_mesh(pp=...) (it follows the backend), or pass device= the mesh's device"
        )
    names = mesh.mesh_dim_names
    if not names or "pp" not in names:
        raise ValueError(
            f"the mesh has dimensions {names!r} but no 'pp' (pipeline) dimension; name the pipeline "
            f"dimension 'pp', e.g. init_device_mesh(..., mesh_dim_names=('pp', 'dp_shard')) or make_mesh(pp=...)"
        )
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ValueError(
            f"the mesh has dimension(s) {unknown} that a pipeline does not know; name its dimensions "
            f"among {list(MESH_DIMS)} (torchtitan's names)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"the mesh names a dimension twice: {names!r}; give each dimension one name")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"the mesh {dict(zip(names, mesh.mesh.shape))} holds {mesh.size()} ranks but the world has "
            f"{world}; a pipeline's mesh spans every rank (make_mesh sizes whose product is {world})"
        )
    return mesh
