"""Tiny models for the recompute tests, and the oracle check against the plain model."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn


class Attention(nn.Module):
    """Explicit softmax attention (not SDPA), so that softmax is an op of its own."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)  # 3 x [B, T, D]
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D/H]
        scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5  # [B, H, T, T]
        probs = self.drop(scores.softmax(-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def blocks(n: int = 4, d: int = 8, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d, 2, dropout) for _ in range(n)])


def sample(batch: int = 4, seq: int = 6, d: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def step(model: nn.Module, x: torch.Tensor, seed: int = 123) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Output, parameter gradients and input gradient of one forward/backward."""
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    y = model(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin()).sum().backward()
    return y.detach(), [p.grad for p in model.parameters()], x.grad


def assert_same_as_plain(plain: nn.Module, configure: Callable[[nn.Module], object], x: torch.Tensor,
                         steps: int = 2, exact: bool = True) -> nn.Module:
    """Configures a deepcopy of ``plain`` and checks outputs and every gradient against it, ``steps`` times."""
    model = copy.deepcopy(plain)
    configure(model)
    tol = dict(rtol=0, atol=0) if exact else {}
    expected = step(plain, x)
    for _ in range(steps):  # the first call of a selective layer plans, the next ones use the plan
        got = step(model, x)
        torch.testing.assert_close(got[0], expected[0], **tol)
        for g, e in zip(got[1], expected[1]):
            torch.testing.assert_close(g, e, **tol)
        torch.testing.assert_close(got[2], expected[2], **tol)
    return model


def kept_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Activation bytes a forward keeps for backward (output excluded), counted."""
    from pipe.recompute import ActivationMemory

    x = x.detach().requires_grad_()
    with ActivationMemory() as memory:
        y = model(x)
        kept = memory.live_bytes - y.untyped_storage().nbytes()
        y.sum().backward()
    return kept
