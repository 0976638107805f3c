"""Pipeline x data parallel: each replica gets part of the global batch; loss and gradients are the whole batch's."""
from __future__ import annotations

import copy

import torch.nn.functional as F

from dist_models import batch, blocks, check_against_oracle
from pipe.distributed import DistributedPipe, make_mesh
from spawn_ranks import run_ranks


def _replicas(rank: int, world: int) -> list[str]:
    checked = []
    # 2 stages x 2 replicas (pipelines {0, 2} and {1, 3}; ranks 0 and 1, stage 0's replicas, average), then 1 x 4.
    for replicas, chunks, schedule in ((2, 3, "1f1b"), (4, 2, "gpipe")):
        model = blocks(8)
        pipe = DistributedPipe(copy.deepcopy(model), chunks=chunks, schedule=schedule,
                               mesh=make_mesh(pp=world // replicas, dp_replicate=replicas))
        inputs, target = batch(24, seed=replicas)
        share = 24 // replicas  # 12 rows with chunks=3 -> 4+4+4; 6 rows with chunks=2 -> 3+3
        rows = slice(pipe.topology.replica * share, (pipe.topology.replica + 1) * share)
        mine = (inputs[0][rows], {"scale": inputs[1]["scale"], "ids": inputs[1]["ids"][rows]})
        loss = pipe.step(mine, target[rows], F.mse_loss, broadcast_loss=True)
        # Loss (on every rank, thanks to broadcast_loss) and gradients are those of the 24-row batch.
        check_against_oracle(pipe, model, inputs, target, loss, f"{replicas} replicas")
        checked.append(f"{replicas}x{pipe.topology.ranks}:{pipe.topology.replica}/{pipe.stages}")
    return checked


def test_loss_and_gradients_match_one_process_on_the_global_batch() -> None:
    results = run_ranks(_replicas, 4, deadline=120.0)
    assert results == [
        ["2x2:0/[0]", "4x1:0/[0]"], ["2x2:1/[0]", "4x1:1/[0]"],
        ["2x2:0/[1]", "4x1:2/[0]"], ["2x2:1/[1]", "4x1:3/[0]"],
    ]
