"""The decoder of examples/parallelism.py at test sizes (seconds on two cores), with its data and loss.

One definition of the model, its tensor-parallel plans (Megatron's
column/row split; torchtitan's sequence parallelism) and its loss, shared by
the example and the mesh tests.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from parallelism import decoder as _decoder, lm_loss, tensor_parallel_plan  # noqa: E402

__all__ = ["VOCAB", "LENGTH", "decoder", "lm_data", "lm_loss", "tensor_parallel_plan"]

VOCAB, WIDTH, HEADS, LENGTH = 32, 16, 4, 8


def decoder(seed: int = 0, blocks: int = 2) -> nn.Sequential:
    """Embedding, ``blocks`` blocks, norm and head (``blocks + 2`` layers), initialised from ``seed``."""
    return _decoder(VOCAB, WIDTH, HEADS, blocks, seed)


def lm_data(step: int, batch: int = 4) -> tuple[Tensor, Tensor]:
    """``(ids, next ids)`` of ``batch`` random sequences of ``LENGTH`` tokens, drawn from ``step``."""
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch, LENGTH + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]
