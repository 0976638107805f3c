"""A model factory for ``pipe-plan``'s first commands (README, docs/planner.md): four MLP blocks.

``pipe-plan --model MODULE:FUNCTION`` imports ``MODULE`` from the current
directory and calls ``FUNCTION()`` for the ``nn.Sequential`` to plan. From the
root of pipe's source tree::

    pipe-plan --model examples.cli_models:build --input-shape 16,16 --budget 60KiB --stages 2

Your own model: a module with a function like :func:`build` that returns it.
"""
from __future__ import annotations

import torch
from torch import nn


def build() -> nn.Sequential:
    """Four ``Linear(16, 64) + ReLU + Linear(64, 16)`` blocks, seeded: the same model at every call."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4)])
