"""Tensor-parallel stages: torch's ``parallelize_module`` on the mesh's ``"tp"`` dimension, per stage.

The user names modules of the plain model (or ``fnmatch`` patterns over those
names) and gives each a ``ParallelStyle`` (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``...). Every rank
applies the entries that fall in the stages it holds, with torch's own
``parallelize_module`` on the ``"tp"`` sub-mesh, before FSDP shards the stage
(torchtitan's order: split, tensor parallel, checkpointing, compile, FSDP).

The ranks of one tensor-parallel group hold the same stages and run the same
schedule; each sends to, and receives from, the rank with the same ``"tp"``
coordinate in the next stage. Most plans end a block in a plain tensor
(``use_local_output=True``, torch's default), which then crosses ranks as any
other. A stage whose output is a ``DTensor`` (sequence parallelism, or
``use_local_output=False``) sends its local shard with the layout beside it::

    stage s (tp rank t)                        stage s+1 (tp rank t)
    out: DTensor(Shard(1)) ─ to_local() ─▶ (Layout, local) ─ from_local(mesh["tp"]) ─▶ DTensor(Shard(1))

Both conversions are differentiable and run inside the stage's cell
(:func:`pipe.distributed.stage_function.stage_function`, for the stage's value and
its skips alike), so the gradient that comes back is the local shard's
gradient, and nothing else in the runtime needs to know about DTensors. This is what torch's ``PipelineStage`` does with its ``get_mesh``
callback; here the receiver's mesh is its own ``"tp"`` sub-mesh.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from pipe.core.microbatch import flatten, unflatten
from pipe.distributed import split_tensor_parallel

__all__: list[str] = []

logger = logging.getLogger(__name__)

TensorParallelPlan = Mapping[str, ParallelStyle]
"""Plain-model module name (or ``fnmatch`` pattern) -> ``ParallelStyle``."""


def verify_plan(plan: Any) -> dict[str, ParallelStyle]:
    """Checks the type of a ``tensor_parallel=`` argument.

    Raises:
        TypeError: not a mapping of str to ``ParallelStyle``.
    """
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"tensor_parallel must be a non-empty dict of module name (or fnmatch pattern) -> ParallelStyle, got "
            f"{plan!r}; e.g. {{'*.attn.qkv': ColwiseParallel(), '*.attn.out': RowwiseParallel()}}"
        )
    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tensor_parallel entry {name!r}: {style!r} must map a module name (str) to a ParallelStyle "
                f"from torch.distributed.tensor.parallel (ColwiseParallel(), RowwiseParallel(), ...)"
            )
    return dict(plan)


def resolve_plan(plan: Mapping[str, ParallelStyle],
                 stages: Sequence[nn.Module]) -> list[dict[str, ParallelStyle]]:
    """Which module of which stage each entry of ``plan`` names.

    Args:
        plan: module name or pattern -> style; names are the plain model's
            (``"3.attn.qkv"``), as in its ``state_dict`` keys.
        stages: every stage of the pipeline (the skeleton), in order.

    Returns:
        Per stage, the exact module names it holds -> style.

    Raises:
        ValueError: an entry matches no module of any stage, or one module is
            matched by two entries.
    """
    per_stage: list[dict[str, ParallelStyle]] = [{} for _ in stages]
    chosen_by: dict[str, str] = {}
    for pattern, style in plan.items():
        matched = False
        for s, stage in enumerate(stages):
            for name in _plain_names(stage):
                if not fnmatch.fnmatchcase(name, pattern):
                    continue
                if chosen_by.get(name, pattern) != pattern:  # (one name in two stages: a tied weight's holders)
                    raise ValueError(
                        f"tensor_parallel entries {chosen_by[name]!r} and {pattern!r} both match module {name!r}; "
                        f"give each module one ParallelStyle (narrow one of the patterns)"
                    )
                chosen_by[name] = pattern
                per_stage[s][name] = style
                matched = True
        if not matched:
            names = [name for stage in stages for name in _plain_names(stage)]
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(
                f"tensor_parallel entry {pattern!r} matches no module of any stage; name modules of the plain "
                f"model as in its state_dict keys, or use an fnmatch pattern (modules: {shown})"
            )
    return per_stage


def _plain_names(stage: nn.Module) -> list[str]:
    """The plain model's names of ``stage``'s modules: a split stage's modules carry them under the stage."""
    split = split_tensor_parallel.plain_modules(stage)
    return split if split else [name for name, _ in stage.named_modules() if name]


def apply(partitions: Mapping[int, nn.Module], stage_plans: Sequence[Mapping[str, ParallelStyle]],
          tp_mesh: DeviceMesh) -> None:
    """Applies each owned stage's plan with ``parallelize_module`` on ``tp_mesh`` (in place); in the graphs of
    ``pipe.split`` stages with :mod:`pipe.distributed.split_tensor_parallel`."""
    split: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # a weight tied within this rank is split once
    for s, partition in partitions.items():
        if not stage_plans[s]:
            continue
        if split_tensor_parallel.plain_modules(partition):
            split_tensor_parallel.apply_to_partition(partition, stage_plans[s], tp_mesh, split)
        else:
            parallelize_module(partition, tp_mesh, dict(stage_plans[s]))
            logger.info("stage %d: tensor parallel over %d ranks: %s", s, tp_mesh.size(), sorted(stage_plans[s]))
    split_tensor_parallel.refuse_half_split_ties(partitions.values(), split)


# -- DTensors across pipeline ranks ----------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """What a receiver needs to rebuild a ``DTensor`` from its local shard (the mesh is its own)."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def to_wire(value: Any) -> Any:
    """Replaces every ``DTensor`` in ``value`` by ``(Layout, local shard)``; other values pass unchanged."""
    leaves, spec = flatten(value)
    if not any(isinstance(leaf, DTensor) for leaf in leaves):
        return value
    converted = [(Layout(tuple(leaf.placements), leaf.shape, tuple(leaf.stride())), _local(leaf))
                 if isinstance(leaf, DTensor) else leaf for leaf in leaves]
    return unflatten(converted, spec)


def _local(tensor: DTensor) -> Tensor:
    """The local shard as a tensor with storage (differentiably).

    The output of a collective (a ``RowwiseParallel`` reduce-scatter) is an
    ``AsyncCollectiveTensor``, a wrapper whose bytes exist once waited for;
    sends and the in-place checks of a checkpointed cell need the bytes.
    """
    local = tensor.to_local()
    if isinstance(local, AsyncCollectiveTensor):
        local = wait_tensor(local)  # differentiable (identity backward)
    return local


def from_wire(value: Any, mesh: DeviceMesh) -> Any:
    """Inverse of :func:`to_wire` on the receiving rank: ``(Layout, local)`` pairs become DTensors on ``mesh``."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Layout):
        layout, local = value
        return DTensor.from_local(local, mesh, layout.placements, run_check=False, shape=layout.shape,
                                  stride=layout.stride)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        items = [from_wire(item, mesh) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {key: from_wire(item, mesh) for key, item in value.items()}
    return value


# -- gradient norms over sharded gradients ---------------------------------------------------------


def tp_submesh(mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
    """The ``"tp"`` sub-mesh of ``mesh``, or None if it has no such dimension (or it has size 1)."""
    if mesh is None or mesh.mesh_dim_names is None or "tp" not in mesh.mesh_dim_names:
        return None
    sub = mesh["tp"]
    return sub if sub.size() > 1 else None
