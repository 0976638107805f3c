"""The process runner against the plain module: every schedule x checkpoint mode, on 2 gloo ranks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dist_models import batch, blocks, check_against_oracle, oracle
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks

CHECKPOINTS = ("always", "except_last", "never")


def _schedules(rank: int, world: int, schedule: str) -> int:
    virtual = 2 if schedule == "interleaved" else 1
    checked = 0
    for checkpoint in CHECKPOINTS:
        model = blocks(8)
        pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                               virtual_stages=virtual, loss_fn=F.mse_loss)
        assert pipe.stages == [rank + world * v for v in range(virtual)]
        # An uneven last micro-batch (10 = 3+3+2+2), then another batch size (7 = 2+2+2+1).
        for size, seed in ((10, 0), (7, 1)):
            inputs, target = batch(size, seed)
            pipe.zero_grad()
            loss = pipe.step(inputs, target)
            check_against_oracle(pipe, model, inputs, target, loss, f"{schedule}/{checkpoint}/B={size}")
            checked += 1
        # Forwards only: the output of the last stage equals the plain module's.
        inputs, _ = batch(9, 2)
        output = pipe(inputs)
        if pipe.is_last:
            expected, _, _ = oracle(model, inputs, torch.zeros(9, 3))
            torch.testing.assert_close(output, expected)
        else:
            assert output is None
    return checked


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_matches_plain_module(schedule: str) -> None:
    assert run_ranks(_schedules, 2, schedule) == [6, 6]
