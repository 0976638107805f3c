"""Train the transformer language model of ``transformer_lm.py`` as a multi-process 1F1B pipeline.

The model, data and learning-rate schedule are those of ``transformer_lm.py``
(imported, not copied); here each half of the model is a torchrun rank, the
micro-batches flow between the ranks with ``torch.distributed`` point-to-point
messages, and the schedule is 1F1B with ``except_last`` checkpointing. Every
rank draws the same batches (the data is small); the first rank feeds the
inputs, the last computes the loss.

Run it on the CPU (2 ranks, one thread each; a few minutes)::

    bash launch/single_node.sh examples/transformer_lm_distributed.py
    bash launch/single_node.sh examples/transformer_lm_distributed.py --steps 3 --layers 2 --width 32  # smoke test
    NPROC=4 bash launch/single_node.sh examples/transformer_lm_distributed.py --data-parallel 2
    bash launch/single_node.sh examples/transformer_lm_distributed.py --recompute examples/recompute.yaml --memory

``--recompute`` applies a MindFormers-style recompute/swap YAML as ``Pipe``
does (stage = balance entry; the YAML's per-stage counts assume 4 blocks, i.e.
6 layers in 2 stages of 3); ``--memory`` logs each rank's peak activation
memory of one step without and with it.

The last line printed (by rank 0) is a summary: first and last training loss,
validation loss and wall time. ``--save DIR`` writes a stage-agnostic
checkpoint (torch.distributed.checkpoint) that ``--resume DIR`` loads with any
number of ranks, or that ``pipe.distributed.state.load_module`` loads into the
plain model.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer_lm import CharData, build_model, learning_rate  # noqa: E402  (the single-process example)

import pipe.distributed as pd  # noqa: E402
from pipe.distributed import state  # noqa: E402
from pipe.recompute import ActivationMemory  # noqa: E402

log = logging.getLogger("transformer_lm_distributed")


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # [B*T, V] vs [B*T]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step and replica")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sequence")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (--schedule interleaved)")
    p.add_argument("--data-parallel", type=int, default=1, help="replicas of the pipeline (the mesh's dp_replicate; "
                   "each stage's replicas on consecutive ranks)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--save", metavar="DIR", help="save a stage-agnostic checkpoint at the end")
    p.add_argument("--resume", metavar="DIR", help="start from a checkpoint saved with --save (any rank count)")
    p.add_argument("--recompute", metavar="YAML", help="recompute/swap config, as for Pipe (examples/recompute.yaml; "
                   "stage = balance entry, one count per rank with --virtual-stages)")
    p.add_argument("--memory", action="store_true", help="before training, log each rank's peak activation "
                   "memory of one step without and with --recompute (counted by pipe.recompute.ActivationMemory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = pd.init_from_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s")

    torch.manual_seed(args.seed)
    data = CharData(args.seed)
    # Every rank builds the same model (small here; build it under torch.device("meta") or
    # pass a layer factory when it is not) and keeps its own stages.
    plain = build_model(data.vocab_size, args.width, args.layers, args.heads, args.seq_len, args.dropout)
    # pipeline ranks x replicas (make_mesh names the sizes and the fix when they do not make the world)
    mesh = pd.make_mesh(pp=max(1, env.world_size // args.data_parallel), dp_replicate=args.data_parallel)
    if args.memory:
        measure_memory(plain, data, args, env.rank, mesh)
    model = pd.DistributedPipe(plain, chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule,
                               virtual_stages=args.virtual_stages, mesh=mesh, loss_fn=lm_loss,
                               recompute=args.recompute)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    start_step = 0
    if args.resume:
        start_step = int(state.load(args.resume, model, optimizer).get("step", 0))
    log.info("rank %d/%d: stages %s of %d, balance %s, schedule %s, chunks %d, checkpoint %r",
             env.rank, env.world_size, model.stages, model.schedule.stages, model.balance, args.schedule,
             args.chunks, args.checkpoint)

    # Replicas draw different batches; the ranks of one pipeline draw the same.
    generator = torch.Generator().manual_seed(args.seed * 1000 + model.topology.replica)
    for _ in range(start_step):
        data.batch("train", args.batch_size, args.seq_len, generator)
    first_loss = last_loss = float("nan")
    start = time.perf_counter()
    bar = tqdm(range(start_step, args.steps), desc="train", unit="step", disable=env.rank != 0, dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        x, y = data.batch("train", args.batch_size, args.seq_len, generator)  # [B, T], [B, T]
        x, y = x.to(model.device), y.to(model.device)  # the rank's device: cuda:LOCAL_RANK under NCCL
        loss = model.step(x, y, broadcast_loss=True)  # the same value on every rank
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = float(loss)
        if step == start_step:
            first_loss = last_loss
        bar.set_postfix(loss=f"{last_loss:.3f}")
    bar.close()
    train_time = time.perf_counter() - start

    val_loss = evaluate(model, data, args)
    if args.save:
        state.save(args.save, model, optimizer, step=args.steps)
    log.info("done: %d steps, loss %.3f -> %.3f, val loss %.3f, %.1f s (%.0f samples/s per replica)",
             args.steps - start_step, first_loss, last_loss, val_loss, train_time,
             (args.steps - start_step) * args.batch_size / max(train_time, 1e-9))
    dist.barrier()  # every rank is done with every group before any rank closes its connections
    dist.destroy_process_group()


def measure_memory(plain: torch.nn.Sequential, data: CharData, args: argparse.Namespace, rank: int,
                   mesh: DeviceMesh) -> None:
    """Logs (on rank 0) every rank's peak activation bytes of one step, without and with ``--recompute``.

    The counts are those of :class:`pipe.recompute.ActivationMemory` (bytes of
    the storages created during the step, independent of the allocator), after
    one warm-up step so that selective recompute has made its plans.
    """
    peaks = []
    for config in (None, args.recompute):
        model = pd.DistributedPipe(copy.deepcopy(plain), chunks=args.chunks, checkpoint=args.checkpoint,
                                   schedule=args.schedule, virtual_stages=args.virtual_stages,
                                   mesh=mesh, loss_fn=lm_loss, recompute=config)
        x, y = data.batch("train", args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
        x, y = x.to(model.device), y.to(model.device)
        model.step(x, y)
        with ActivationMemory() as memory:
            model.step(x, y)
        peaks.append(memory.peak_bytes)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (rank, *peaks))
    for r, without, with_config in every:
        log.info("memory: rank %d peak activation bytes of a step: %d without the config, %d with it "
                 "(saved %d, %.2fx)", r, without, with_config, without - with_config, with_config / max(without, 1))


@torch.no_grad()
def evaluate(model: pd.DistributedPipe, data: CharData, args: argparse.Namespace) -> float:
    """Mean validation loss over fixed batches, known on every rank."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    total = torch.zeros((), device=model.device)  # NCCL reduces CUDA tensors only
    for _ in range(args.eval_batches):
        x, y = data.batch("val", args.batch_size, args.seq_len, generator)
        x, y = x.to(model.device), y.to(model.device)
        logits = model(x)  # on the last stage's rank, None elsewhere
        if logits is not None:
            total += lm_loss(logits, y)
    dist.all_reduce(total)  # only the last stage's ranks contributed
    model.train()
    return float(total) / args.eval_batches / args.data_parallel


if __name__ == "__main__":
    main()
