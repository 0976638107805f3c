"""Where a rank's shard of a ``DTensor`` lies in the whole tensor: the blocks it holds, for files to read and write.

torch describes a shard as one block of the whole
(``compute_local_shape_and_global_offset``), which a ``_StridedShard`` is
not: tensor parallelism over GPT-2's fused ``c_attn`` gives rank r of n its
columns ``[r*k, (r+1)*k)`` of each of q, k and v (``_StridedShard(1,
split_factor=3)``), three blocks of the whole. :func:`pieces` lists them,
each as a view of the local tensor and the block's offset in the whole.
:mod:`pipe.distributed.hf` reads and writes a HuggingFace directory by
them, and :mod:`pipe.distributed.state` gives them to
``torch.distributed.checkpoint`` as the chunks a rank holds, so that a
checkpoint of a strided layout loads into any other layout and back.

The placements are read left to right, as DTensor reads them: a
``Shard(d)`` over m ranks takes the rank's chunk (``torch.chunk``) of what
the mesh dimensions before it left of dimension d; a ``_StridedShard(d,
split_factor=s)`` cuts that into s equal groups first and takes the rank's
chunk of each.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from torch import Tensor
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
