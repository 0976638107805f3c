"""In-place layers at a stage's start (pipe.core.inplace) on 2 gloo ranks, against the plain module.

The second stage starts with an in-place layer on the activations it
received (a leaf before pipe.core.inplace.own); the first stage of the second
model starts with one on the micro-batches of the input.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from dist_models import WIDTH, check_against_oracle
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks


def _models() -> list[tuple[str, nn.Sequential]]:
    torch.manual_seed(3)
    received = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.LeakyReLU(0.1, inplace=True),
                             nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    first = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH), nn.ELU(inplace=True),
                          nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    return [("received", received), ("first", first)]


def _inplace(rank: int, world: int) -> int:
    checked = 0
    for name, model in _models():
        for schedule in ("gpipe", "1f1b"):
            for checkpoint in ("always", "except_last", "never"):
                pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                       balance=[2, 4], loss_fn=F.mse_loss)
                for step in range(2):  # the first step learns which stages modify their input
                    generator = torch.Generator().manual_seed(step)
                    x = torch.randn(10, WIDTH, generator=generator)
                    target = torch.randn(10, WIDTH, generator=generator)
                    pipe.zero_grad()
                    loss = pipe.step(x.clone(), target)
                    check_against_oracle(pipe, model, x, target, loss, f"{name}/{schedule}/{checkpoint}/{step}")
                    checked += 1
    return checked


def test_inplace_layers_at_stage_starts() -> None:
    assert run_ranks(_inplace, 2) == [24, 24]
