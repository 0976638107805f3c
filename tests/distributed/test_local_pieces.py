"""The blocks of the whole that a rank's shard of a DTensor holds (``pipe.distributed.local_pieces``), against DTensor.

Each layout is made by ``distribute_tensor`` on a (2, 2) mesh of 4 gloo
ranks; every block :func:`pieces` names must equal that block of the whole,
and the blocks must cover the local shard. The strided layouts are tensor
parallelism over a fused layer's parts (GPT-2's ``c_attn``) and FSDP2 over it;
the one FSDP2 cannot take (strided along the dimension it shards) is refused.
"""
from __future__ import annotations

from typing import Any

import torch

from spawn_ranks import run_ranks


def _check(rank: int, world: int) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from pipe.distributed.local_pieces import pieces

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = torch.arange(12 * 24, dtype=torch.float32).reshape(12, 24)
    layouts: dict[str, Any] = {
        "shard, shard": (Shard(0), Shard(0)),
        "fsdp over a fused split": (Shard(0), _StridedShard(1, split_factor=3)),
        "fsdp over a column split": (_StridedShard(0, split_factor=2), Shard(0)),
        "shard, replicate": (Shard(1), Replicate()),
        "replicate, fused split": (Replicate(), _StridedShard(1, split_factor=3)),
        "one dimension twice": (Shard(1), _StridedShard(1, split_factor=3)),
    }
    counts = {}
    for label, placements in layouts.items():
        tensor = distribute_tensor(whole, mesh, placements)
        blocks = pieces(tensor)
        for view, offset in blocks:
            block = whole[tuple(slice(start, start + size) for start, size in zip(offset, view.shape))]
            assert torch.equal(view, block), (label, offset)
        assert sum(view.numel() for view, _ in blocks) == tensor.to_local().numel(), label
        counts[label] = len(blocks)
    plain = torch.ones(3, 4)
    assert [offset for _, offset in pieces(plain)] == [(0, 0)]
    # FSDP2 would shard dimension 0 of a weight split part by part along it (a fused q, k, v nn.Linear) again,
    # which DTensor cannot describe: refused, named; GPT-2's Conv1D is strided along dimension 1 and passes.
    from torch import nn

    from pipe.distributed.fsdp import _refuse_strided_first_dim

    _refuse_strided_first_dim(nn.Parameter(distribute_tensor(whole, mesh["tp"], [_StridedShard(1, split_factor=3)])),
                              "attn.c_attn.weight")
    try:
        _refuse_strided_first_dim(nn.Parameter(distribute_tensor(whole, mesh["tp"], [_StridedShard(0, split_factor=3)])),
                                  "attn.qkv.weight")
        counts["refused"] = 0
    except ValueError as error:
        assert "'attn.qkv.weight' is split by tensor parallelism part by part along its first dimension" in str(error)
        counts["refused"] = 1
    return counts


def test_the_blocks_of_a_shard_are_the_whole_tensors_blocks_for_plain_and_strided_layouts() -> None:
    for counts in run_ranks(_check, 4):
        assert counts == {"shard, shard": 1, "fsdp over a fused split": 3, "fsdp over a column split": 1,
                          "shard, replicate": 1, "replicate, fused split": 3, "one dimension twice": 3,
                          "refused": 1}
