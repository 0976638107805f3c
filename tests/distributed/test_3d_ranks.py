"""Pipeline x FSDP2 x tensor parallel on one (pp 2, dp_shard 2, tp 2) mesh: 8 gloo ranks against the plain decoder.

torchtitan's 3-D layout: each stage's blocks split Megatron-style over the tp
pair (with and without sequence parallelism), then sharded by FSDP2 over the
dp_shard pair, each shard pair fed its half of the batch, the stages run by the
pipeline. Each rank runs the plain decoder on the whole batch and compares the
loss, every gradient gathered to a full tensor, the clipped norm and the
weights after 3 AdamW steps. The same spawn runs replicas of tensor-parallel
stages on (pp 2, dp_replicate 2, tp 2) and HSDP of them on (pp 1,
dp_replicate 2, dp_shard 2, tp 2).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
from torch.distributed.tensor import DTensor

import pipe.distributed as pd
from decoder import decoder, tensor_parallel_plan, train_against
from spawn_ranks import run_ranks

CASES = [  # (sequence parallel, schedule, checkpoint, reshard after forward, embedding tied to the head)
    (True, "1f1b", "except_last", True, False),
    (False, "interleaved", "always", False, False),
    (True, "zbv", "never", True, False),  # the split backward: W of weights sharded over both dimensions
    (True, "1f1b", "never", True, True),  # a tie over the pipeline, sharded by tp and FSDP on both ends
]


def _against_plain(mesh: Any, sequence_parallel: bool, schedule: str, checkpoint: str, reshard: Optional[bool],
                   tied: bool) -> dict[str, Any]:
    model = decoder(0, blocks=2 if schedule == "1f1b" else 6)
    if tied:
        model[-1].out.weight = model[0].tok.weight
    reference = copy.deepcopy(model)
    virtual = 1 if schedule == "1f1b" else 2
    piped = pd.DistributedPipe(model, chunks=2, checkpoint=checkpoint, schedule=schedule, virtual_stages=virtual,
                               mesh=mesh, tensor_parallel=tensor_parallel_plan(sequence_parallel),
                               shard=None if reshard is None else pd.Shard(reshard_after_forward=reshard))
    label = f"sequence_parallel={sequence_parallel} {schedule} {checkpoint} reshard={reshard} tied={tied}"
    # The reference steps on the pipeline's gradients once they are compared (train_against says why), so the
    # weights compare as tightly as the gradients, on any CPU.
    trained = train_against(piped, reference, label, batch=lambda step: 8, clip=0.5, weights_atol=1e-5)
    # Each block's weights are DTensors over both the shard and the tp dimension of the mesh.
    layouts = {name: tuple(p.device_mesh.mesh_dim_names or ()) for name, p in piped.named_parameters()
               if isinstance(p, DTensor) and ".mlp.fc." in name}
    return {"layouts": sorted(set(layouts.values())),
            "replica": (piped.topology.data_parallel, piped.topology.replica), "norm": trained["norm"]}


def _three_d(rank: int, world: int) -> list[dict[str, Any]]:
    mesh = pd.make_mesh(pp=2, dp_shard=2, tp=2)
    results = [_against_plain(mesh, *case) for case in CASES]
    # Replicas of tensor-parallel stages (the averager takes each DTensor gradient's local shard), tied too;
    # HSDP of tensor-parallel stages on one pipeline rank.
    replicas = pd.make_mesh(pp=2, dp_replicate=2, tp=2)
    results.append(_against_plain(replicas, True, "1f1b", "except_last", None, False))
    results.append(_against_plain(replicas, False, "1f1b", "never", None, True))
    results.append(_against_plain(pd.make_mesh(pp=1, dp_replicate=2, dp_shard=2, tp=2), True, "1f1b", "except_last",
                                  True, False))
    return results


@pytest.mark.timeout(300)
def test_pipeline_fsdp_and_tensor_parallel_on_one_mesh_match_the_plain_model() -> None:
    results = run_ranks(_three_d, 8, deadline=280.0, timeout=120.0)
    for k in range(len(CASES) + 3):
        case = [r[k] for r in results]
        assert len({round(c["norm"], 6) for c in case}) == 1, case
        if k < len(CASES) + 2:
            # Ranks 0-3 run pipeline rank 0, ranks 4-7 pipeline rank 1; tp pairs are consecutive, shard pairs 2 apart.
            assert [c["replica"] for c in case] == [(2, 0), (2, 0), (2, 1), (2, 1)] * 2, case
        # Sharded by FSDP and tp: DTensors on both dimensions; replicas: on tp only; HSDP: replicated, sharded, tp.
        layout = [("dp_shard", "tp")] if k < len(CASES) else [("tp",)] if k < len(CASES) + 2 else \
            [("dp_replicate", "dp_shard", "tp")]
        assert all(c["layouts"] == layout for c in case), (k, case)
