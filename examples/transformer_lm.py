"""Train a small character-level transformer language model with ``pipe.Pipe``.

The model is a decoder-only transformer (pre-LN blocks, causal self-attention,
GELU MLP) written as a plain ``nn.Sequential`` of layers that each take and
return one tensor, so ``Pipe`` can cut it into two partitions and stream
micro-batches through them: embedding and the first half of the blocks on one
CPU worker, the other half and the head on the second. The text is Python's own
interactive help (``pydoc_data.topics``, about 460 KB of English prose that
ships with every CPython), so nothing is downloaded.

Run it (about 4 minutes on 2 CPU cores: 241 s measured on a fresh 2-core
machine; the training loss falls from ~4.7, a uniform guess over the ~100
characters, to ~1.4)::

    python examples/transformer_lm.py
    python examples/transformer_lm.py --chunks 8 --checkpoint always --sample
    python examples/transformer_lm.py --steps 3 --layers 2 --width 32   # smoke test
    python examples/transformer_lm.py --steps 5 --trace run.json && pipe-viz trace run.json --plan -o run.html

The last line printed is a summary: first and last training loss, validation
loss and wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import pipe.trace
from pipe import Pipe

log = logging.getLogger("transformer_lm")


# --------------------------------------------------------------------------
# Data: Python's help text, encoded as characters.
# --------------------------------------------------------------------------


class CharData:
    """The help topics of ``pydoc`` as one long tensor of character ids."""

    def __init__(self, seed: int, val_fraction: float = 0.1) -> None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[name] for name in sorted(topics))
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)  # [N]
        n_val = int(len(ids) * val_fraction)
        self.train, self.val = ids[:-n_val], ids[-n_val:]
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of ``split``: inputs and next-character targets, both [B, T]."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(
            len(data) - seq_len - 1, (batch_size,), generator=generator or self.generator
        )  # [B]
        offsets = torch.arange(seq_len)  # [T]
        x = data[starts[:, None] + offsets]  # [B, T]
        y = data[starts[:, None] + offsets + 1]  # [B, T]
        return x, y


# --------------------------------------------------------------------------
# Model: every layer takes one tensor and returns one tensor.
# --------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token ids [B, T] -> token + learned position embeddings [B, T, C]."""

    def __init__(self, vocab_size: int, width: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape  # idx: [B, T] of token ids
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.tokens(idx) + self.positions(pos)  # [B, T, C] + [T, C] -> [B, T, C]
        return self.dropout(x)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}; pick --heads dividing --width")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # [B, T, C]
        H = self.heads
        qkv = self.qkv(x).view(B, T, 3, H, C // H)  # [B, T, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, D]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return self.resid_dropout(self.proj(y))  # [B, T, C]


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # [B, T, C] -> [B, T, 4C] -> [B, T, C]


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). [B, T, C] -> [B, T, C]."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # [B, T, C]
        x = x + self.mlp(self.ln2(x))  # [B, T, C]
        return x


class Head(nn.Module):
    """Final LayerNorm and projection to logits: [B, T, C] -> [B, T, V].

    The projection is not tied to the token embedding: the two live in
    different partitions, and ``Pipe`` refuses layers that share parameters.
    """

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # [B, T, V]


def build_model(
    vocab_size: int, width: int, layers: int, heads: int, seq_len: int, dropout: float
) -> nn.Sequential:
    """Embedding, ``layers`` blocks and the head, as one flat ``nn.Sequential``."""
    model = nn.Sequential(
        Embedding(vocab_size, width, seq_len, dropout),
        *[Block(width, heads, dropout) for _ in range(layers)],
        Head(width, vocab_size),
    )
    # GPT-2 initialisation; residual projections are scaled down with depth.
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
        nn.init.normal_(p, mean=0.0, std=std)
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def even_balance(layers: int) -> list[int]:
    """Layers per partition for two partitions: the blocks split evenly.

    The embedding joins the first half of the blocks, the head the second half:
    4 blocks -> [1 + 2, 2 + 1] = [3, 3].
    """
    first = layers // 2
    return [1 + first, layers - first + 1]


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: Pipe, data: CharData, args: argparse.Namespace) -> float:
    """Mean validation loss over a fixed set of batches (the same ones every time)."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in range(args.eval_batches):
        x, y = data.batch("val", args.batch_size, args.seq_len, generator)  # [B, T], [B, T]
        logits = model(x.to(model.devices[0]))  # [B, T, V]
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.to(logits.device).flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model: Pipe, data: CharData, args: argparse.Namespace, prompt: str = "The ") -> str:
    """Generate characters one at a time from ``prompt``.

    A plain forward through the pipeline in eval mode. One sequence per
    micro-batch is generated (the batch must have at least ``chunks`` rows);
    the first is returned.
    """
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 2)
    idx = torch.tensor([data.encode(prompt)] * args.chunks)  # [N, T0]
    for _ in range(args.sample_chars):
        context = idx[:, -args.seq_len :]  # [N, <= T]
        logits = model(context.to(model.devices[0]))[:, -1, :].cpu()  # [N, V] at the last position
        probs = F.softmax(logits / args.temperature, dim=-1)  # [N, V]
        nxt = torch.multinomial(probs, 1, generator=generator)  # [N, 1]
        idx = torch.cat([idx, nxt], dim=1)  # [N, T0 + t + 1]
    model.train()
    return data.decode(idx[0].tolist())


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 10% of steps (at least 20, so that a short run's loss falls too),
    then cosine decay to lr/10."""
    warmup = max(20, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step, split into --chunks micro-batches")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sequence (context length)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument(
        "--checkpoint",
        default="except_last",
        choices=["always", "except_last", "never"],
        help="activation recomputation policy",
    )
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (split evenly over 2 partitions)")
    p.add_argument("--width", type=int, default=128, help="embedding width C")
    p.add_argument("--heads", type=int, default=4, help="attention heads (must divide --width)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="batches per validation loss")
    p.add_argument("--sample", action="store_true", help="print a generated text sample at the end")
    p.add_argument("--sample-chars", type=int, default=300, help="characters to generate with --sample")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--trace", metavar="PATH", help="record training steps 2-3 as a Chrome trace (draw it with "
                   "`pipe-viz trace PATH --plan -o run.html`, or open it in ui.perfetto.dev)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: need at least one step")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: need at least 2 blocks to split over 2 partitions")
    if args.batch_size < args.chunks:
        p.error(f"--batch-size {args.batch_size} is smaller than --chunks {args.chunks}; use at least one row per micro-batch")
    return args


class TqdmHandler(logging.Handler):
    """Log lines written above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    torch.manual_seed(args.seed)
    data = CharData(args.seed)
    net = build_model(data.vocab_size, args.width, args.layers, args.heads, args.seq_len, args.dropout)
    n_params = sum(p.numel() for p in net.parameters())

    # Two partitions on two CPU workers, each running on its own thread.
    balance = even_balance(args.layers)
    model = Pipe(net, chunks=args.chunks, checkpoint=args.checkpoint, balance=balance, devices=["cpu", "cpu"])
    in_device, out_device = model.devices[0], model.devices[-1]
    log.info(
        "text: %d train / %d val characters, vocabulary %d | model: %.2fM parameters, %d blocks of width %d | "
        "pipe: balance %s, chunks %d, checkpoint %r",
        len(data.train), len(data.val), data.vocab_size, n_params / 1e6, args.layers, args.width,
        balance, args.chunks, args.checkpoint,
    )  # fmt: skip

    # Weight decay on the matrices (linear and embedding weights), not on biases or LayerNorm.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    first_loss = last_loss = float("nan")
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    # --trace: record two steps after two warm-up steps (pipe.trace; see docs/visualisation.md).
    traced = range(min(2, args.steps - 1), min(4, args.steps))
    recording = contextlib.ExitStack()
    for step in bar:
        if args.trace and step == traced.start:
            recording.enter_context(pipe.trace.record(args.trace, schedule="gpipe", checkpoint=args.checkpoint))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)

        x, y = data.batch("train", args.batch_size, args.seq_len)  # [B, T], [B, T]
        logits = model(x.to(in_device))  # [B, T, V], on the last partition's device
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(out_device).flatten())  # [B*T, V] vs [B*T]

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.trace and step + 1 == traced.stop:
            recording.close()  # writes the trace
            log.info("trace of steps %d-%d: %s (pipe-viz trace %s --plan -o run.html)",
                     traced.start, traced.stop - 1, args.trace, args.trace)

        last_loss = loss.item()
        if step == 0:
            first_loss = last_loss
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{last_loss:.3f}", samples_s=f"{(step + 1) * args.batch_size / elapsed:.0f}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            log.info("step %d: train loss %.3f, val loss %.3f", step + 1, last_loss, evaluate(model, data, args))
    bar.close()
    train_time = time.perf_counter() - start

    val_loss = evaluate(model, data, args)
    log.info("step %d: train loss %.3f, val loss %.3f", args.steps, last_loss, val_loss)
    if args.sample:
        log.info("sample:\n%s", sample(model, data, args))

    elapsed = time.perf_counter() - start
    log.info(
        "done: %d steps, loss %.3f -> %.3f, val loss %.3f, %.1f s (%.0f samples/s)",
        args.steps, first_loss, last_loss, val_loss, elapsed, args.steps * args.batch_size / train_time,
    )  # fmt: skip


if __name__ == "__main__":
    main()
