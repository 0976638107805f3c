"""Replicas of a pipeline: pipe's gradient averager against torch's FSDP-based ``replicate``.

Both train the same model on (pp 2, dp_replicate 2): 4 gloo ranks on this
machine, one intra-op thread each, a stack of pre-norm residual MLP blocks
(width W, L blocks), 1F1B with M micro-batches of a B-row batch per replica,
AdamW. ``averager`` is ``DistributedPipe``'s default: after a stage's last
backward of the step its gradients are all-reduced in 25 MiB buckets
(:mod:`pipe.distributed.data_parallel`). ``torch`` wraps every block and the
stage with torch's FSDP2-based ``replicate`` (the one ``PipelineStage``
recognises) and lets the runner drive it like an FSDP stage (one all-reduce
per block per step, :mod:`pipe.distributed.fsdp`). Each configuration runs
in fresh processes, the two alternating ``--repeats`` times; the script
prints the median step time of each, their ratio (torch / averager, above 1
means torch's is slower), the peak resident memory each rank gained, and
checks that both give the same losses. Results: benchmarks/results/replicas.json.

Run:
    python benchmarks/replicas.py            # W=512 L=8 B=256 M=4, 3 repeats: about 4 minutes
    python benchmarks/replicas.py --quick    # W=128 B=64, 1 repeat: about 30 seconds
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from forked_ranks import run_forked_ranks

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("averager", "torch")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _rank(rank: int, port: int, mode: str, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    try:
        _measure(rank, port, mode, args, results)
    except BaseException as error:  # report instead of leaving the parent waiting
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        raise


def _measure(rank: int, port: int, mode: str, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=600))
    import pipe.distributed as pd
    from pipe.distributed.fsdp import StageSharding
    from pipe.distributed.runtime import Runtime
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.width) for _ in range(args.layers)])
    pipe = pd.DistributedPipe(model, chunks=args.microbatches, schedule="1f1b",
                              mesh=pd.make_mesh(pp=2, dp_replicate=2), checkpoint="never")
    if mode == "torch":
        replicas = pipe.mesh["dp_replicate"]
        for stage in pipe.partitions.values():
            for layer in stage.children():
                replicate(layer, mesh=replicas)
            replicate(stage, mesh=replicas)
        runtime = pipe._runtime  # the same runner, with torch's replicas reduced as FSDP stages
        pipe._runtime = Runtime(runtime.stages, runtime.schedule, runtime.topology, runtime.transport, runtime.skips,
                                None, StageSharding(dict(pipe.partitions),
                                                    pd.Shard(reshard_after_forward=False, unit="stage"),
                                                    pipe.schedule.stages - 1))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + pipe.topology.replica)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randn(args.batch, args.width, generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = pipe.step(x, y, F.mse_loss, broadcast_loss=True)
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
        assert loss is not None
        losses.append(float(loss))
    results.put({"rank": rank, "step_s": statistics.median(times), "losses": losses,
                 "rss_gain_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    args.width, args.layers, args.batch, args.microbatches = (128, 8, 64, 4) if args.quick else (512, 8, 256, 4)
    args.warmup, args.steps = (1, 3) if args.quick else (2, 8)
    repeats = args.repeats or (1 if args.quick else 3)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:  # alternating, each in fresh processes
            ranks = run_forked_ranks(_rank, mode, args, ranks=4, timeout=900)
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                raise SystemExit(f"{mode}: {errors}")
            runs[mode].append({"step_s": max(r["step_s"] for r in ranks),
                               "rss_gain_kib": max(r["rss_gain_kib"] for r in ranks),
                               "losses": ranks[0]["losses"]})
    step = {mode: statistics.median(r["step_s"] for r in runs[mode]) for mode in MODES}
    rss = {mode: statistics.median(r["rss_gain_kib"] for r in runs[mode]) for mode in MODES}
    same_losses = all(r["losses"] == runs["averager"][0]["losses"] for mode in MODES for r in runs[mode])
    load = os.getloadavg()
    result = {
        "config": {"width": args.width, "layers": args.layers, "batch_per_replica": args.batch,
                   "microbatches": args.microbatches, "mesh": "pp 2 x dp_replicate 2", "schedule": "1f1b",
                   "repeats": repeats, "quick": args.quick},
        "step_s": step, "peak_rss_gain_kib": rss,
        "step_ratio_torch_vs_averager": step["torch"] / step["averager"],
        "rss_ratio_torch_vs_averager": rss["torch"] / max(rss["averager"], 1),
        "step_s_per_repeat": {mode: [r["step_s"] for r in runs[mode]] for mode in MODES},
        "losses_equal": same_losses,
        "load_average": load, "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=HERE).stdout.strip(),
    }
    for mode in MODES:
        print(f"{mode:9s} step {step[mode] * 1000:8.1f} ms   peak RSS gained {rss[mode] / 1024:8.1f} MiB")
    print(f"torch / averager: step time {result['step_ratio_torch_vs_averager']:.2f}x, "
          f"peak RSS gained {result['rss_ratio_torch_vs_averager']:.2f}x; losses equal: {same_losses}; "
          f"load {load[0]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    name = "replicas-quick.json" if args.quick else "replicas.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULTS / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
