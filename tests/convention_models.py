"""Models written for torch's pipeline calling convention (``PipeSequential``), shared by the tests.

A small transformer encoder whose layers take several arguments: token ids
and a padding mask go in as ``model(tokens, mask, scale)``; each block takes
and returns ``(x, mask)``; a pair of layers hands ``[x, mask]`` on as one list
(a list stays one value); the head pools over the real tokens. Without dropout,
so that any number of micro-batches computes what the plain model computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipe import PipeSequential
from pipe.skip import pop, skippable, stash

VOCAB, WIDTH, HEADS, CLASSES, LENGTH = 11, 8, 2, 3, 5


class Embed(nn.Module):
    """``(tokens, mask, scale)`` -> ``(x, mask)``: ``scale`` is a Python float, not split."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)

    def forward(self, tokens: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        if not isinstance(scale, float):
            raise TypeError(f"scale must reach the layer as a float, got {scale!r}")
        return self.tokens(tokens) * scale + self.positions, mask


class Attention(nn.Module):
    """``(x, mask)`` -> ``(x, mask)``: self-attention over the real tokens (``mask`` is True there)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.norm(x)
        h, _ = self.attention(h, h, h, key_padding_mask=~mask, need_weights=False)
        return x + h, mask


class Pack(nn.Module):
    """``(x, mask)`` -> ``[x, mask]``: a list, which the next layer must receive as one value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, mask: Tensor) -> list[Tensor]:
        return [torch.tanh(self.linear(x)), mask]


class Unpack(nn.Module):
    """``[x, mask]`` (one argument) -> ``(x, mask)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: list[Tensor]) -> tuple[Tensor, Tensor]:
        if not isinstance(pair, list):
            raise TypeError(f"Unpack takes one list, got {type(pair).__name__}")
        x, mask = pair
        return x + self.linear(x), mask


class Pool(nn.Module):
    """``(x, mask)`` -> logits: the mean over the real tokens, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1)
        return self.linear(pooled)


@skippable(stash=["residual"])
class StashResidual(nn.Module):
    """``(x, mask)`` -> ``(x, mask)``, stashing ``x`` for :class:`AddResidual`."""

    def forward(self, x: Tensor, mask: Tensor):  # type: ignore[no-untyped-def]
        yield stash("residual", x)
        return x, mask


@skippable(pop=["residual"])
class AddResidual(nn.Module):
    """``(x, mask)`` -> ``(x + residual, mask)``."""

    def forward(self, x: Tensor, mask: Tensor):  # type: ignore[no-untyped-def]
        residual = yield pop("residual")
        return x + residual, mask


def encoder(seed: int = 0) -> PipeSequential:
    """Embed | Attention | Pack | Unpack | Attention | Pool: tuples between most layers, a list once."""
    torch.manual_seed(seed)
    return PipeSequential(Embed(), Attention(), Pack(), Unpack(), Attention(), Pool())


def skip_encoder(seed: int = 0) -> PipeSequential:
    """Embed | StashResidual | Attention | Attention | AddResidual | Pool."""
    torch.manual_seed(seed)
    return PipeSequential(Embed(), StashResidual(), Attention(), Attention(), AddResidual(), Pool())


def inputs(size: int, seed: int = 0) -> tuple[Tensor, Tensor, float]:
    """``(tokens, mask, scale)``: every row has at least one real token."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (size,), generator=generator)
    mask = torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)
    return tokens, mask, 0.5


def targets(size: int, seed: int = 0) -> Tensor:
    return torch.randint(0, CLASSES, (size,), generator=torch.Generator().manual_seed(seed + 100))


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target)
