"""The process runner against the plain module: every schedule x checkpoint mode, on 2 gloo ranks."""
from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from dist_models import WIDTH, batch, blocks, check_against_oracle, oracle, skip_model
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


def _skips(rank: int, world: int) -> int:
    """Skips between non-adjacent stages: across ranks, and (interleaved) between two stages of one rank."""
    if world == 3:
        cases = [("1f1b", 1, skip_model(0, 4, 6))]  # stage 0 (rank 0) -> stage 2 (rank 2)
    else:
        cases = [("interleaved", 2, skip_model(1, 5, 8)),  # stage 0 -> stage 2: both on rank 0
                 ("interleaved", 2, skip_model(1, 7, 8)),  # stage 0 -> stage 3: rank 0 -> rank 1
                 ("gpipe", 1, skip_model(0, 3, 4))]  # stage 0 -> stage 1, through a skip channel
    checked = 0
    for schedule, virtual, model in cases:
        for checkpoint in CHECKPOINTS:
            pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                   virtual_stages=virtual)
            generator = torch.Generator().manual_seed(checked)
            x = torch.randn(10, WIDTH, generator=generator)
            target = torch.randn(10, WIDTH, generator=generator)
            loss = pipe.step(x, target, F.mse_loss)
            check_against_oracle(pipe, model, x, target, loss, f"skip {schedule}/{checkpoint}")
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_skip_connections_between_non_adjacent_stages(world: int) -> None:
    assert run_ranks(_skips, world) == [9 if world == 2 else 3] * world


def _constructed_everywhere() -> None:
    """Waits until every rank has built its pipe. This harness's store lives in rank 0, and a rank still creating
    its groups (which reads the store) when rank 0 fails at once and exits found the store gone: "Connection
    reset by peer" in CI under load. (Under torchrun the store outlives rank 0.)"""
    torch.distributed.barrier()


def _on_another_device(rank: int, world: int) -> str:
    # A CPU pipeline given tensors on the meta device: as a GPU rank (cuda:LOCAL_RANK) given a CPU batch.
    # Rank 0 (the first stage) gets its inputs there, rank 1 (the last) its target.
    pipe = DistributedPipe(blocks(4), chunks=2, loss_fn=F.mse_loss)
    _constructed_everywhere()
    (x, extra), target = batch(4, 0)
    try:
        pipe.step((x, {**extra, "ids": extra["ids"].to("meta")}) if rank == 0 else None,
                  target.to("meta") if rank == 1 else None)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _forward_on_another_device(rank: int, world: int) -> str:
    pipe = DistributedPipe(blocks(4), chunks=2, loss_fn=F.mse_loss)
    _constructed_everywhere()
    (x, extra), _ = batch(4, 0)
    try:
        pipe((x.to("meta"), extra) if rank == 0 else None)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_inputs_and_targets_on_another_device_than_the_rank_are_named() -> None:
    first, last = run_ranks(_on_another_device, 2, barrier=False)
    assert "an input is on meta but this rank's stages are on cpu; move it with inputs.to(pipe.device)" in first
    assert "a target is on meta but this rank's stages are on cpu; move it with target.to(pipe.device)" in last
    # Forwards only: the rank given a bad input says so, and the other stops naming it when it ends, not
    # after the process group's timeout. (This harness's store lives in rank 0, so rank 1 finds it gone and
    # says rank 0 died; under torchrun the store outlives rank 0 and rank 1 quotes its error.)
    start = time.monotonic()
    first, last = run_ranks(_forward_on_another_device, 2, barrier=False, timeout=60.0)
    assert first.startswith("ValueError: an input is on meta"), first
    assert last.startswith("PipelineFailure: rank 1 stopped in F0@1 because rank 0"), last
    assert time.monotonic() - start < 30, "the other rank waited for the timeout"
