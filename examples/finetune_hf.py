"""Fine-tune a HuggingFace causal LM on a text file, as a pipeline on any (pp, dp_shard, dp_replicate) mesh.

The road a pretrained model travels through pipe, with no process ever holding
the whole model:

1. every rank builds the model from its ``config.json`` on ``torch.device("meta")``
   (no memory), cuts it into ``--pp`` stages with ``pipe.split``, and
   ``DistributedPipe`` materialises only the rank's own stage;
2. ``pipe.distributed.hf.load`` reads the rank's tensors (its stage's, and under
   FSDP only its shard of them) from the directory's safetensors;
3. training: a tqdm bar on rank 0, ``eval_step`` on held-out text, DCP
   checkpoints (``pipe.distributed.state``) every ``--save-every`` steps that
   ``--resume`` continues from, at the same or another layout;
4. ``pipe.distributed.hf.save`` writes a HuggingFace directory (safetensors
   shards, their index and the config) from every rank at once, which
   ``AutoModelForCausalLM.from_pretrained`` loads; ``loss.png`` beside it.

Without ``--model``, ``--config`` (a ``config.json`` or a directory holding
one) gives a random start, initialised by the model's own initialiser.

The text is tokenized with the model directory's tokenizer if it has one, else
as bytes (the vocabulary must then hold 256 ids). Run it (2 ranks, the model
directory and text file local; nothing is downloaded)::

    bash launch/single_node.sh examples/finetune_hf.py --model ./my-llama --data train.txt --out ./run
    NPROC=4 bash launch/single_node.sh examples/finetune_hf.py --model ./my-llama --data train.txt \\
        --pp 2 --dp-shard 2 --out ./run --resume ./run/checkpoint
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('./run/hf')"

Tensor parallelism (``tp``) is not offered here: ``pipe.split`` stages are
graphs that apply their weights directly, which torch's tensor-parallel styles
cannot split (docs/parallelism.md); models written as ``nn.Sequential`` of
modules take ``tensor_parallel=`` (``examples/parallelism.py``).

The last line printed (by rank 0) is a summary: first and last training loss,
the validation loss before and after, and where the export went.
"""
from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import pipe
import pipe.distributed as pd
from pipe.distributed import hf, state

log = logging.getLogger("finetune_hf")


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: position t predicts token t + 1. logits [B, T, V], ids [B, T]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a local HuggingFace model directory (config.json + safetensors)")
    source.add_argument("--config", type=Path, help="a config.json (or a directory with one): a random start")
    p.add_argument("--data", type=Path, required=True, help="a local text file; its last 10%% is held out")
    p.add_argument("--out", type=Path, required=True, help="folder for checkpoint/, hf/ and loss.png")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: %(default)s)")
    p.add_argument("--dp-shard", type=int, default=1, help="FSDP2 shards of each stage")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas of the pipeline")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zbv"])
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per pipeline rank (interleaved: 2, zbv: 2)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run counts on)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all data-parallel ranks")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="held-out loss every N steps (and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="DCP checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", type=Path, help="a checkpoint folder written by this script (any layout)")
    return p.parse_args(argv)


class TokenStream:
    """The text file as token ids, cut into training and held-out sequences."""

    def __init__(self, path: Path, model_dir: Optional[Path], vocab_size: int, seq_len: int) -> None:
        text = path.read_text(encoding="utf-8")
        tokenizer = _tokenizer(model_dir)
        if tokenizer is not None:
            ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        elif vocab_size >= 256:
            ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        else:
            raise SystemExit(f"the model has no tokenizer files and a vocabulary of {vocab_size} < 256 ids: give it "
                             "a tokenizer (tokenizer.save_pretrained into the model directory) or a byte vocabulary")
        held = max(seq_len, len(ids) // 10)
        self.train, self.held_out = ids[:-held], ids[-held:]
        if len(self.train) <= seq_len or len(self.held_out) < seq_len:
            raise SystemExit(f"{path}: {len(ids)} tokens are too few for --seq-len {seq_len}: give more text")
        self.seq_len = seq_len

    def batch(self, step: int, size: int, seed: int) -> torch.Tensor:
        """``size`` training sequences [B, T], drawn from ``(seed, step)``: a resumed run draws the same."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.train) - self.seq_len, (size,), generator=generator)
        return torch.stack([self.train[s:s + self.seq_len] for s in starts.tolist()])

    def evaluation(self, size: int) -> torch.Tensor:
        """The held-out text's first ``size`` sequences (fewer if it is short), [B, T]."""
        count = min(size, len(self.held_out) // self.seq_len)
        return self.held_out[:count * self.seq_len].view(count, self.seq_len)


def _tokenizer(model_dir: Optional[Path]) -> Any:
    if model_dir is None or not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model",
                                                                             "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def cut_points(model: nn.Module, layers: int, stages: int) -> list[str]:
    """Where each stage but the first begins: the decoder layers' module list, cut evenly."""
    found = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and
             len(module) == layers]
    if not found:
        raise SystemExit(f"no list of {layers} decoder layers in {type(model).__name__}: pass a causal LM")
    if not 1 <= stages <= layers:
        raise SystemExit(f"{stages} stages for {layers} decoder layers: use at most {layers} (--pp x virtual stages)")
    return [f"{found[0]}.{round(k * layers / stages)}" for k in range(1, stages)]


def build(args: argparse.Namespace, world: int) -> tuple[pd.DistributedPipe, Any]:
    """The pipeline on this rank (its stage materialised, nothing else) and the model's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model or args.config)
    config.use_cache = False
    torch.manual_seed(args.seed)  # a random start is the same on every rank
    with torch.device("meta"):  # no memory: each rank materialises its own stage only
        model = AutoModelForCausalLM.from_config(config)
    virtual = args.virtual_stages
    # One piece per stage; with one stage (--pp 1), two pieces on the one rank: pipe.split needs a cut.
    at = cut_points(model, config.num_hidden_layers, max(args.pp * virtual, 2))
    example = torch.zeros(2, args.seq_len, dtype=torch.long, device="meta")
    stages = pipe.split(model, (example,), {"use_cache": False}, at=at)
    if args.pp * args.dp_shard * args.dp_replicate != world:
        raise SystemExit(f"--pp {args.pp} x --dp-shard {args.dp_shard} x --dp-replicate {args.dp_replicate} != "
                         f"{world} ranks: launch {args.pp * args.dp_shard * args.dp_replicate} (NPROC=...)")
    mesh = pd.make_mesh(pp=args.pp, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate)
    piped = pd.DistributedPipe(stages, chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule,
                               virtual_stages=virtual, mesh=mesh, loss_fn=lm_loss)
    return piped, config


def evaluate(model: pd.DistributedPipe, data: TokenStream, args: argparse.Namespace) -> float:
    """The held-out loss, forwards only, the same on every rank."""
    ids = data.evaluation(args.batch_size)
    parts, part = model.topology.data_parallel, model.topology.replica
    rows = ids[part * len(ids) // parts:(part + 1) * len(ids) // parts].to(model.device)
    model.eval()
    loss = model.eval_step(rows, rows, broadcast_loss=True)
    model.train()
    return float(loss)


def plot(path: Path, losses: list[tuple[int, float]], evals: list[tuple[int, float]]) -> None:
    """The loss curve (training and held-out) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    if losses:
        axes.plot(*zip(*losses), label="training", linewidth=1)
    if evals:
        axes.plot(*zip(*evals), "o-", label="held out")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    env = pd.init_from_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s")
    model, config = build(args, env.world_size)
    if args.model:
        hf.load(args.model, model)  # each rank reads its own tensors (its shards under FSDP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = TokenStream(args.data, args.model, config.vocab_size, args.seq_len)
    start = 0
    if args.resume:
        start = int(state.load(args.resume, model, optimizer)["step"])
        log.info("resumed from %s at step %d", args.resume, start)
    parts, part = model.topology.data_parallel, model.topology.replica
    if args.batch_size % (parts * args.chunks):
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {parts} data-parallel part(s) of "
                         f"--chunks {args.chunks} micro-batches")
    log.info("rank %d/%d: stages %s of %d, mesh pp %d x dp_shard %d x dp_replicate %d, %s parameters here",
             env.rank, env.world_size, model.stages, model.schedule.stages, args.pp, args.dp_shard,
             args.dp_replicate, f"{sum(p.numel() for p in model.parameters()):,}")

    losses: list[tuple[int, float]] = []
    evals = [(start, evaluate(model, data, args))]
    began = time.perf_counter()
    bar = tqdm(range(start, args.steps), desc="fine-tune", unit="step", disable=env.rank != 0, dynamic_ncols=True)
    for step in bar:
        ids = data.batch(step, args.batch_size, args.seed)
        rows = ids[part * len(ids) // parts:(part + 1) * len(ids) // parts].to(model.device)
        loss = float(model.step(rows, rows, broadcast_loss=True))
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: the loss is {loss}; lower --lr or check the model and data")
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((step + 1, loss))
        bar.set_postfix(loss=f"{loss:.3f}")
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            evals.append((done, evaluate(model, data, args)))
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            state.save(args.out / "checkpoint", model, optimizer, step=done)
    bar.close()

    hf.save(args.out / "hf", model, config=config)  # every rank writes its own tensors
    if env.rank == 0:
        plot(args.out / "loss.png", losses, evals)
    first = losses[0][1] if losses else float("nan")
    last = losses[-1][1] if losses else float("nan")
    log.info("done: steps %d-%d, loss %.3f -> %.3f, held-out %.3f -> %.3f, %.1f s; exported to %s",
             start, args.steps, first, last, evals[0][1], evals[-1][1], time.perf_counter() - began,
             args.out / "hf")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
