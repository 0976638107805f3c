"""ActivationMemory: counted bytes of what a forward keeps for backward."""
from __future__ import annotations

import torch
from torch import nn

from pipe.recompute import ActivationMemory


def test_counts_exactly_what_a_linear_gelu_linear_keeps() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16, requires_grad=True)
    with ActivationMemory() as memory:
        y = model(x)
        # fc1 output and GELU output ([32, 64] each) plus the output [32, 16]; views (w.t()) are free
        assert memory.live_bytes == (2 * 32 * 64 + 32 * 16) * 4
        y.sum().backward()
        del y
    assert memory.peak_bytes >= (2 * 32 * 64 + 32 * 16) * 4
    assert memory.live_bytes < memory.peak_bytes


def test_freed_storages_are_subtracted() -> None:
    with ActivationMemory() as memory:
        a = torch.ones(100) * 2
        b = a + 1
        assert memory.live_bytes == 800
        del a, b
    assert memory.live_bytes == 0 and memory.peak_bytes == 800
    memory.reset_peak()
    assert memory.peak_bytes == 0
