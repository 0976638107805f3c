"""Train a small decoder as a pipeline on a DeviceMesh: FSDP2 shards, replicas or tensor parallelism per stage.

Four ranks, two pipeline stages, and on the second mesh dimension one of:

    --layout shard       (pp 2, dp_shard 2): ZeRO-3, each stage's parameters, gradients and AdamW state halved
    --layout zero2       the same, parameters kept gathered from a stage's first action of the step to its last
    --layout replicate   (pp 2, dp_replicate 2): full replicas, gradients averaged
    --layout tp          (pp 2, tp 2): attention heads and MLP columns split (Megatron's column/row linears)
    --layout tp-sp       the same with sequence parallelism: activations sharded on the sequence between blocks

Data-parallel ranks draw different batches; the two ranks of a tensor-parallel
group draw the same. ``--save DIR`` writes a sharded checkpoint
(torch.distributed.checkpoint) under the plain model's keys, which
``--resume DIR`` loads at any other layout (or ``pipe.distributed.state.load_module``
into the plain model in one process).

Run it on the CPU (4 ranks, one thread each; about a minute)::

    bash launch/parallelism.sh                                   # --layout shard
    bash launch/parallelism.sh --layout tp-sp --steps 5
    bash launch/parallelism.sh --steps 5 --save /tmp/ckpt && bash launch/parallelism.sh --layout tp --resume /tmp/ckpt

The last line printed (by rank 0) gives the first and last loss.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

import pipe.distributed as pd
from pipe.distributed import state

log = logging.getLogger("parallelism")


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, d)
        return self.tok(ids)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections, so a column-wise split keeps whole heads.

    The key projection has no bias: its gradient would be zero (softmax ignores a
    shift shared by all keys).
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width, bias=False), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # (B, heads on this rank, T, head width): -1 heads, so the code runs whole and tp-split alike
        q, k, v = (f(x).view(b, t, -1, self.head_width).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.ln_f, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, vocab)
        return self.out(self.ln_f(x))


def decoder(vocab: int = 32, width: int = 16, heads: int = 4, blocks: int = 2, seed: int = 0) -> nn.Sequential:
    """Embedding, ``blocks`` pre-norm blocks, norm and head: ``blocks + 2`` layers for the pipeline to cut."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, width), *[Block(width, heads) for _ in range(blocks)], Head(vocab, width))


def tensor_parallel_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's split of the blocks; with ``sequence_parallel``, torchtitan's, sequence-sharded between blocks.

    Without: q, k, v and the MLP's first linear column-wise, the output
    projections row-wise; blocks take and return whole (replicated) tensors.
    With: the embedding's output, the norms and the residual stream are
    ``DTensor``s sharded on the sequence (``Shard(1)``), so every stage
    boundary carries one; the head gathers the logits whole.
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


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B*T, vocab) vs (B*T)


def build(layout: str, args: argparse.Namespace) -> pd.DistributedPipe:
    """The pipeline of ``layout`` over the 4 ranks (see the module docstring)."""
    model = decoder(args.vocab, args.width, args.heads, args.blocks)
    if layout in ("shard", "zero2"):
        return pd.DistributedPipe(model, chunks=args.chunks, schedule="1f1b", mesh=pd.make_mesh(pp=2, dp_shard=2),
                                  shard=pd.Shard(reshard_after_forward=layout == "shard"))
    if layout == "replicate":
        return pd.DistributedPipe(model, chunks=args.chunks, schedule="1f1b", mesh=pd.make_mesh(pp=2, dp_replicate=2))
    return pd.DistributedPipe(model, chunks=args.chunks, schedule="1f1b", mesh=pd.make_mesh(pp=2, tp=2),
                              tensor_parallel=tensor_parallel_plan(layout == "tp-sp"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=["shard", "zero2", "replicate", "tp", "tp-sp"], default="shard")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step and data-parallel rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--save", help="write a sharded checkpoint here at the end")
    p.add_argument("--resume", help="load a checkpoint written by --save (at any layout) first")
    args = p.parse_args(argv)
    env = pd.init_from_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s")
    model = build(args.layout, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first_step = state.load(args.resume, model, optimizer)["step"] if args.resume else 0
    part = model.topology.replica  # this rank's share of the data (the same on both ranks of a tp group)
    losses = []
    start = time.perf_counter()
    for step in range(first_step, first_step + args.steps):
        generator = torch.Generator().manual_seed(1000 * step + part)
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=generator)
        ids[:, 1::2] = ids[:, 0:-1:2]  # every other token repeats the one before: something to learn
        ids = ids.to(model.device)  # the rank's device: cuda:LOCAL_RANK under NCCL
        loss = model.step(ids[:, :-1], ids[:, 1:], lm_loss, broadcast_loss=True)
        model.clip_grad_norm_(1.0)  # over every stage, shard and tp rank
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        log.info("step %d: loss %.4f", step, losses[-1])
    if args.save:
        state.save(args.save, model, optimizer, step=first_step + args.steps)
    log.info("done: layout %s, %d steps from step %d, loss %.4f -> %.4f, %.1f s", args.layout, args.steps,
             first_step, losses[0], losses[-1], time.perf_counter() - start)


if __name__ == "__main__":
    main()
