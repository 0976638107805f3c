"""Apply a MindFormers-style recompute config (YAML) to a transformer, check it, train with it.

The model is the one of ``examples/transformer_lm.py`` (embedding, pre-LN
blocks, head as one ``nn.Sequential``). The script

1. reads the YAML config, applies it to a copy of the model without ``Pipe``
   (``pipe.recompute.apply_recompute_config``; the normalised strategy is
   logged per layer), and checks one step against the plain model: same loss,
   same gradients, and the activation memory each keeps for backward
   (``pipe.recompute.ActivationMemory``, counted bytes, not timed);
2. trains with ``Pipe(..., checkpoint="never", recompute=config)`` over two CPU
   partitions (stage = partition) and prints the loss.

Run it (about 20 seconds on 2 CPU cores)::

    python examples/recompute_config.py
    python examples/recompute_config.py --config examples/recompute_swap.yaml
    python examples/recompute_config.py --steps 2    # smoke test

On the CPU, offload (``swap_config``) copies tensors to a second CPU buffer:
the mechanism runs but saves nothing; on a GPU it moves them to pinned host
memory.
"""
from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lm import CharData, build_model, even_balance

from pipe import Pipe
from pipe.recompute import ActivationMemory, apply_recompute_config, load_config

log = logging.getLogger("recompute_config")
HERE = Path(__file__).resolve().parent


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, list[torch.Tensor]]:
    """Loss, activation bytes kept after forward, and gradients of one step (no Pipe)."""
    model.zero_grad(set_to_none=True)
    with ActivationMemory() as memory:
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        kept = memory.live_bytes
        loss.backward()
    return loss.item(), kept, [p.grad for p in model.parameters()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "recompute.yaml"), help="YAML file (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="training steps with Pipe (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (the YAML assumes 4)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--checkpoint", choices=["always", "except_last", "never"], default=None,
                   help="Pipe checkpoint mode (default: never, or except_last when the config has checkpoint_swap)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(args.config)
    checkpoint = args.checkpoint or ("except_last" if (config.get("swap_config") or {}).get("checkpoint_swap")
                                     else "never")

    torch.manual_seed(args.seed)
    data = CharData(args.seed)
    plain = build_model(data.vocab_size, args.width, args.layers, args.heads, args.seq_len, dropout=0.0)
    balance = even_balance(args.layers)

    # 1. The config on the plain model (no Pipe): same loss and gradients, less memory kept.
    log.info("== %s applied without Pipe, stages %s", args.config, balance)
    configured = copy.deepcopy(plain)
    apply_recompute_config(configured, config, stages=balance)
    x, y = data.batch("train", args.batch_size, args.seq_len)  # [B, T], [B, T]
    one_step(configured, x, y)  # the first call of a selective layer plans what to keep
    loss0, kept0, grads0 = one_step(plain, x, y)
    loss1, kept1, grads1 = one_step(configured, x, y)
    diff = max((a - b).abs().max().item() for a, b in zip(grads0, grads1))
    log.info("plain:      loss %.6f, activations kept for backward %.2f MiB", loss0, kept0 / 2**20)
    log.info("configured: loss %.6f, activations kept for backward %.2f MiB (%+.0f%%), max |grad diff| %.1e",
             loss1, kept1 / 2**20, 100 * (kept1 / kept0 - 1), diff)
    if diff != 0.0 or loss0 != loss1:
        raise SystemExit("the configured model differs from the plain one")

    # 2. Training through Pipe with the same config (stage = partition).
    log.info("== training: Pipe(chunks=%d, checkpoint=%r, balance=%s, recompute=%s)",
             args.chunks, checkpoint, balance, args.config)
    model = Pipe(copy.deepcopy(plain), chunks=args.chunks, checkpoint=checkpoint, balance=balance,
                 devices=["cpu", "cpu"], recompute=args.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    first = last = float("nan")
    for step in range(args.steps):
        x, y = data.batch("train", args.batch_size, args.seq_len)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last = loss.item()
        first = last if step == 0 else first
        if (step + 1) % 10 == 0:
            log.info("step %d: loss %.3f", step + 1, last)
    model.close()
    log.info("done: loss %.3f -> %.3f in %d steps, %.1f s", first, last, args.steps, time.perf_counter() - start)


if __name__ == "__main__":
    main()
