"""A tiny decoder for the mesh tests: token embedding, pre-norm blocks (causal attention + MLP), norm and head.

Written as torchtitan writes its Llama for tensor parallelism: separate q, k, v
projections (a column-wise split of each keeps whole heads on a rank) and
views with ``-1`` heads, so the same code runs whole and with its heads split
over tensor-parallel ranks. The key projection has no bias: its gradient
would be zero (softmax ignores a shift shared by all keys), and AdamW turns
the rounding noise of a zero gradient into steps of full size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

VOCAB, WIDTH, HEADS, LENGTH = 32, 16, 4, 8


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, d)
        return self.tok(ids)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # (B, heads on this rank, T, head width): -1 heads, so a column-wise split keeps whole heads
        q, k, v = (f(x).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_f, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, vocab)
        return self.out(self.ln_f(x))


def decoder(seed: int = 0, blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), *[Block() for _ in range(blocks)], Head())


def lm_data(step: int, batch: int = 4) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch, LENGTH + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def tensor_parallel_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's split of the blocks; with ``sequence_parallel``, torchtitan's, sequence-sharded between blocks.

    Without: q, k, v and the MLP's first linear column-wise, the output
    projections row-wise; blocks take and return whole (replicated) tensors.
    With: the embedding's output, the norms and the residual stream are
    ``DTensor``s sharded on the sequence (``Shard(1)``), so every stage boundary
    carries one.
    """
    if not sequence_parallel:
        return {"*.attn.[qkv]": ColwiseParallel(), "*.attn.proj": RowwiseParallel(),
                "*.mlp.fc": ColwiseParallel(), "*.mlp.proj": RowwiseParallel()}
    rows = Shard(1)
    return {
        "0.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=rows, use_local_output=False),
        "*.ln_[12f]": SequenceParallel(),
        "*.attn.[qkv]": ColwiseParallel(input_layouts=rows),
        "*.attn.proj": RowwiseParallel(output_layouts=rows, use_local_output=False),
        "*.mlp.fc": ColwiseParallel(input_layouts=rows),
        "*.mlp.proj": RowwiseParallel(output_layouts=rows, use_local_output=False),
        "*.out": ColwiseParallel(input_layouts=rows, output_layouts=Replicate()),
    }
