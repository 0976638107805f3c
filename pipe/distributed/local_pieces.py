"""Where a rank's shard of a ``DTensor`` lies in the whole tensor: the blocks it holds, for files to read and write.

torch describes a shard as one block of the whole
(``compute_local_shape_and_global_offset``), which a ``_StridedShard`` is
not: tensor parallelism over GPT-2's fused ``c_attn`` gives rank r of n its
columns ``[r*k, (r+1)*k)`` of each of q, k and v (``_StridedShard(1,
split_factor=3)``), three blocks of the whole. :func:`pieces` lists them,
each as a view of the local tensor and the block's offset in the whole.
:mod:`pipe.distributed.hf` reads and writes a HuggingFace directory by
them, and :mod:`pipe.distributed.state` saves and loads through
:class:`BlockSavePlanner` and :class:`BlockLoadPlanner`, which give
``torch.distributed.checkpoint`` each block as a chunk of its own, so that a
checkpoint of a strided layout loads into any other layout and back.

The placements are read left to right, as DTensor reads them: a
``Shard(d)`` over m ranks takes the rank's chunk (``torch.chunk``) of what
the mesh dimensions before it left of dimension d; a ``_StridedShard(d,
split_factor=s)`` cuts that into s equal groups first and takes the rank's
chunk of each.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__: list[str] = []

Run = tuple[int, int]  # (start in the whole dimension, length)


def pieces(tensor: Tensor) -> list[tuple[Tensor, tuple[int, ...]]]:
    """``(view of this rank's local tensor, that block's offset in the whole)`` for each block it holds.

    A plain tensor is one block at offset 0. A ``DTensor`` is as many as its
    strided placements make (one for ``Shard`` and ``Replicate`` alone).

    Raises:
        ValueError: the local tensor's shape is not what the placements give (a sharding this
            reading does not describe, e.g. a strided dimension that does not divide evenly).
    """
    if not isinstance(tensor, DTensor):
        return [(tensor.detach(), (0,) * tensor.dim())]
    local = tensor.to_local().detach()
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not on this mesh: holds nothing
        return []
    per_dim: list[list[Run]] = [[(0, size)] for size in tensor.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, (Shard, _StridedShard)):  # Replicate, Partial: the whole of each dimension
            continue
        dim = placement.dim % tensor.dim()
        groups = int(placement.split_factor) if isinstance(placement, _StridedShard) else 1
        per_dim[dim] = _take(per_dim[dim], groups, mesh.size(mesh_dim), coordinate[mesh_dim], tensor, dim)
    held = tuple(sum(length for _, length in runs) for runs in per_dim)
    if held != tuple(local.shape):
        raise ValueError(f"a DTensor of shape {list(tensor.shape)} with placements {tensor.placements} holds a local "
                         f"tensor of shape {list(local.shape)}, where its placements give {list(held)}: a sharding "
                         f"pipe cannot read or write as blocks of the whole")
    blocks = []
    for combination in itertools.product(*[_positions(runs) for runs in per_dim]):
        index = tuple(slice(at, at + length) for at, _, length in combination)
        blocks.append((local[index], tuple(start for _, start, _ in combination)))
    return blocks


def _positions(runs: Sequence[Run]) -> list[tuple[int, int, int]]:
    """``(position in the local dimension, start in the whole, length)`` of each run."""
    found, at = [], 0
    for start, length in runs:
        found.append((at, start, length))
        at += length
    return found


def _take(runs: list[Run], groups: int, ranks: int, rank: int, tensor: DTensor, dim: int) -> list[Run]:
    """Rank ``rank``'s chunk (of ``ranks``) of each of ``groups`` equal groups of ``runs``, merged where they touch."""
    total = sum(length for _, length in runs)
    if total % groups:
        raise ValueError(f"a DTensor of shape {list(tensor.shape)} with placements {tensor.placements}: dimension "
                         f"{dim} holds {total} here, which {groups} strided groups do not divide")
    group = total // groups
    chunk = -(-group // ranks)  # torch.chunk's size
    low, high = min(rank * chunk, group), min((rank + 1) * chunk, group)
    taken: list[Run] = []
    for g in range(groups):
        for start, length in _slice(runs, g * group + low, g * group + high):
            if taken and taken[-1][0] + taken[-1][1] == start:
                taken[-1] = (taken[-1][0], taken[-1][1] + length)
            else:
                taken.append((start, length))
    return taken


def _slice(runs: Sequence[Run], low: int, high: int) -> list[Run]:
    """The runs of the whole behind positions ``[low, high)`` of the concatenated ``runs``."""
    found, at = [], 0
    for start, length in runs:
        lo, hi = max(low, at), min(high, at + length)
        if lo < hi:
            found.append((start + lo - at, hi - lo))
        at += length
    return found


# -- the blocks as DCP chunks ---------------------------------------------------------------------


def _blocks(state: dict[str, Any]) -> dict[str, list[tuple[Tensor, tuple[int, ...]]]]:
    """The ``DTensor``s of a flattened state dict whose shard is several blocks of the whole (tensor parallelism
    over a fused layer's parts: :mod:`pipe.distributed.local_pieces`), with their blocks."""
    found = {}
    for key, value in state.items():
        if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is not None:
            blocks = pieces(value)
            if len(blocks) > 1:
                found[key] = blocks
    return found


def _block(blocks: list[tuple[Tensor, tuple[int, ...]]], index: MetadataIndex) -> Tensor:
    return next(view for view, offset in blocks if offset == tuple(index.offset or ()))


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's planner, writing each block of a shard that is several (DTensor describes one) as a chunk of its own,
    so that the checkpoint loads into any layout."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.blocks = _blocks(self.state_dict)
        if not self.blocks:
            return plan
        items = [item for item in plan.items if item.index.fqn not in self.blocks]
        for key, blocks in self.blocks.items():
            for view, offset in blocks:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=view.shape)
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(offset)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties.create_from_tensor(view),
                                                                   size=self.state_dict[key].size())))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.blocks:
            return _block(self.blocks[index.fqn], index).clone()  # the block's bytes alone, not the shard's
        return super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading into each block of a shard that is several."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self.blocks = _blocks(self.state_dict)
        if not self.blocks:
            return plan
        assert self.metadata is not None  # set up before the plan
        items = [item for item in plan.items if item.dest_index.fqn not in self.blocks]
        for key, blocks in self.blocks.items():
            stored = self.metadata.state_dict_metadata[key]
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(f"the checkpoint holds {key!r} as an object, not a tensor: not a checkpoint of this "
                                 f"model (state.save writes every weight as a tensor)")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(offset), sizes=view.shape) for view, offset in blocks]
            items += create_read_items_for_chunk_list(key, stored, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn in self.blocks:
            return _block(self.blocks[index.fqn], index)
        return super().lookup_tensor(index)
