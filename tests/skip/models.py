"""Tiny models for the skip tests: one written with pipe.skip, and its plain twin (the oracle)."""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

from pipe.skip import pop, skippable, stash


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    """y = W x; stashes y, returns tanh(y)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x)
        yield stash("skip", y)
        return torch.tanh(y)


@skippable(pop=["skip"])
class PopLinear(nn.Module):
    """W x + skip."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.linear(x) + skip


def skip_model(width: int = 4, length: int = 6) -> nn.Sequential:
    """StashLinear, length-2 Linear+Tanh pairs, PopLinear: one skip over the whole model."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [StashLinear(width)]
    for _ in range(length - 2):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))
    layers.append(PopLinear(width))
    return nn.Sequential(*layers)


def plain_forward(model: nn.Sequential, x: Tensor) -> Tensor:
    """The oracle: the same layers run by hand, the skip kept in a local variable."""
    saved: dict[tuple[int, str], Optional[Tensor]] = {}
    for layer in model:
        ns = layer.namespaced("skip")[0] if isinstance(layer, (StashLinear, PopLinear)) else None
        key = (id(ns), "skip")
        if isinstance(layer, StashLinear):
            y = layer.linear(x)
            saved[key] = y
            x = torch.tanh(y)
        elif isinstance(layer, PopLinear):
            x = layer.linear(x) + saved.pop(key)
        else:
            x = layer(x)
    return x


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
