"""How a rank's stages are parallelized on the device mesh: tensor parallel, then FSDP or replicas.

``DistributedPipe`` cuts the model into stages; this module applies torch's
engines to the stages this rank holds, in torchtitan's order: tensor
parallelism first (``parallelize_module`` on the mesh's ``"tp"`` dimension,
or the user's ``parallelize=``), then FSDP2 over ``"dp_shard"`` (with HSDP when
``"dp_replicate"`` is there too), or, without sharding, the gradient averager
over ``"dp_replicate"``. It also holds the gradient norm over the whole model,
across pipeline, shard and tensor-parallel ranks.
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from pipe.distributed import tensor_parallel as tp
from pipe.distributed.data_parallel import GradientAverager
from pipe.distributed.fsdp import Shard, StageSharding, shard_mesh, shard_stages
from pipe.distributed.group import Topology
from pipe.distributed.mesh import mesh_size
from pipe.distributed.tied_replicas import TiedReplicas

__all__: list[str] = []

Parallelize = Callable[[nn.Sequential, DeviceMesh], None]


def verify_parallelism(parallelize: Optional[Parallelize], tensor_parallel: Optional[Mapping[str, Any]],
                       mesh: Optional[DeviceMesh]) -> Optional[dict[str, Any]]:
    """Checks ``parallelize=`` and ``tensor_parallel=`` before anything collective; returns the checked plan."""
    if parallelize is not None and not callable(parallelize):
        raise TypeError(f"parallelize must be a function (stage, mesh) -> None, got {parallelize!r}")
    if tensor_parallel is None:
        return None
    plan = tp.verify_plan(tensor_parallel)
    if mesh is None or mesh_size(mesh, "tp") == 1:
        raise ValueError(
            f"tensor_parallel= needs a mesh with a 'tp' dimension of size 2 or more, got mesh "
            f"{None if mesh is None else mesh.mesh_dim_names!r}; pass mesh=make_mesh(pp=..., tp=...)"
        )
    return plan


def parallelize_stages(partitions: dict[int, nn.Sequential], skeleton: list[nn.Sequential], mesh: DeviceMesh,
                       topology: Topology, tied: TiedReplicas, shard: Optional[Shard],
                       parallelize: Optional[Parallelize], tensor_parallel: Optional[dict[str, Any]],
                       schedule: Any) -> tuple[Optional[StageSharding], Optional[GradientAverager]]:
    """Applies tensor parallelism, then FSDP (or the replicas' averager) to this rank's stages.

    Returns what the runtime drives once per step: the FSDP stages, or the averager.

    Raises:
        ValueError: ranks of one pipeline rank hold different parameters (:func:`verify_partners`).
    """
    if topology.data_parallel * topology.tensor_parallel > 1:
        verify_partners(partitions, topology)
    if tensor_parallel is not None:
        tp.apply(partitions, tp.resolve_plan(tensor_parallel, skeleton), mesh["tp"])
    elif parallelize is None and topology.tensor_parallel > 1:
        warnings.warn(
            f"the mesh has tp={topology.tensor_parallel} but neither tensor_parallel= nor parallelize= "
            f"was given: the tensor-parallel ranks all run the whole stage on the same data (correct, but "
            f"{topology.tensor_parallel}x the work); pass tensor_parallel={{module name: ParallelStyle}} "
            f"to split them", stacklevel=3)
    if parallelize is not None:
        for stage in sorted(partitions):
            parallelize(partitions[stage], mesh)
    sharding: Optional[StageSharding] = None
    averager: Optional[GradientAverager] = None
    if shard is not None:
        if tied.within_rank:  # said on every rank, not only where the stages live
            raise ValueError(
                f"the tied weight {tied.within_rank[0]} is held by two stages of one rank, and FSDP "
                f"cannot shard one parameter for two stages; place those stages on different pipeline "
                f"ranks (schedule {schedule!r} puts them together), or untie the weights"
            )
        shard_stages(dict(partitions), shard, shard_mesh(mesh))
        sharding = StageSharding(dict(partitions), shard, len(skeleton) - 1)
    elif topology.replicate > 1:
        averager = GradientAverager(dict(partitions), topology.replicate_group, topology.replicate)
    tied.refresh()  # parallelize_module and fully_shard replace the parameters by DTensors
    tied.verify_layouts()  # the holders of a tie must hold the same shard of it to sum their gradients
    return sharding, averager


def _fingerprint(tensor: Tensor) -> str:
    """A digest of ``tensor``'s bytes: equal exactly when the values are (no reduction whose order could vary)."""
    if tensor.is_meta:  # to be allocated and loaded (init_weights=False): the load's values are one checkpoint's
        return "meta"
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def verify_partners(partitions: dict[int, nn.Sequential], topology: Topology) -> None:
    """Checks, before anything is sharded, that the ranks of one pipeline rank hold the same parameters.

    Shard partners (FSDP keeps each rank's own part), replicas (their gradients
    are averaged, their values never sent) and tensor-parallel ranks must start
    from the same shapes and the same values, or the job trains a model that is
    none of theirs (or fails deep in a collective). One all-gather over the
    world of each parameter's name, shape, dtype and a digest of its bytes.

    Raises:
        ValueError: naming the first parameter that differs, the ranks and the fix.
    """
    mine = [(name, tuple(p.shape), str(p.dtype), _fingerprint(p))
            for s in sorted(partitions) for name, p in partitions[s].named_parameters()]
    everyone: list[Any] = [None] * topology.world
    dist.all_gather_object(everyone, (topology.pipeline_rank, sorted(partitions), mine))
    for pipeline_rank in range(topology.ranks):  # every rank checks every pipeline rank: all raise alike
        partners = [rank for rank, (p, _, _) in enumerate(everyone) if p == pipeline_rank]
        first, (_, stages, reference) = partners[0], everyone[partners[0]]
        for rank in partners[1:]:
            difference = _first_difference(reference, everyone[rank][2])
            if difference is None:
                continue
            a, b = difference
            name = a[0] if a is not None else b[0]  # one of them is not None
            partnership = (f"ranks {first} and {rank} hold pipeline rank {pipeline_rank}'s stages {stages} as "
                           f"data-parallel or tensor-parallel partners, but parameter {name!r}")
            if a is None or b is None or a[:3] != b[:3]:
                def held(x: Any) -> str:
                    return "nothing" if x is None else f"{x[0]} {x[1]} {x[2]}"
                raise ValueError(f"{partnership} differs: rank {first} has {held(a)}, rank {rank} {held(b)}; "
                                 f"build the same model on every rank")
            raise ValueError(
                f"{partnership} starts with other values on each (FSDP would keep each rank's own part, replicas "
                f"would drift apart); seed every rank alike before building the model (torch.manual_seed(0)), or "
                f"load the same weights on every rank")


def _first_difference(a: list[Any], b: list[Any]) -> Optional[tuple[Any, Any]]:
    """The first entries of ``a`` and ``b`` that differ (None past the end of one), or None if they are equal."""
    for k in range(max(len(a), len(b))):
        x = a[k] if k < len(a) else None
        y = b[k] if k < len(b) else None
        if x != y:
            return x, y
    return None


def clip_grad_norm(parameters: Iterable[nn.Parameter], tied: TiedReplicas, pipeline_group: Optional[dist.ProcessGroup],
                   device: torch.device, max_norm: float) -> Tensor:
    """Scales the gradients of ``parameters`` to a global norm of at most ``max_norm``; returns the norm.

    Sharded (``DTensor``) gradients are summed over the mesh dimensions that
    shard them, then everything over the pipeline ranks; a tied weight counts once.
    """
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and tied.counts(p)]
    squares = squared_norm(counted, device)  # a tied weight counts once
    if pipeline_group is not None:
        dist.all_reduce(squares, group=pipeline_group)
    total = squares.sqrt()
    scale = max_norm / (total + 1e-6)
    if scale < 1:
        factor = float(scale)  # a number: DTensor gradients take it as plain ones do
        for grad in grads:
            grad.mul_(factor)
    return total.float()


def squared_norm(grads: Iterable[Tensor], device: torch.device) -> Tensor:
    """The sum of squares of ``grads`` over every rank that holds a shard of them (float64, on ``device``).

    A plain tensor counts as it is. A ``DTensor`` counts its local shard, summed
    over the mesh dimensions on which it is sharded (one all-reduce per group
    of gradients with the same mesh and dimensions) and counted once over
    those on which it is replicated; a ``Partial`` gradient is reduced first. The result is the
    same on every rank of those groups; a pipeline then sums it over its stages.
    """
    plain = torch.zeros((), device=device, dtype=torch.float64)
    sharded: dict[tuple[Any, tuple[int, ...]], tuple[DeviceMesh, Tensor]] = {}
    for grad in grads:
        if not isinstance(grad, DTensor):
            plain += grad.detach().double().pow(2).sum()
            continue
        if any(placement.is_partial() for placement in grad.placements):
            grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
        dims = tuple(d for d, placement in enumerate(grad.placements) if not placement.is_replicate())
        local = grad.to_local().detach().double().pow(2).sum().to(device)
        if not dims:
            plain += local
            continue
        key = (grad.device_mesh.mesh_dim_names, dims)  # the same on every rank of the groups
        if key not in sharded:
            sharded[key] = (grad.device_mesh, torch.zeros((), device=device, dtype=torch.float64))
        sharded[key][1].add_(local)
    for (_, dims), (mesh, total) in sorted(sharded.items(), key=lambda item: repr(item[0])):
        for d in dims:  # summing over one dimension after another sums over all of them
            dist.all_reduce(total, group=mesh.get_group(d))
        plain += total
    return plain
