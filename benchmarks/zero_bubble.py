"""Zero-bubble schedules: step time of 1F1B, interleaved 1F1B, ZB-H1 and ZB-V, with and without checkpointing.

The P5 model (a stack of L Linear+ReLU blocks of width W, B-row batches, MSE
loss) on 2 gloo ranks of this machine, one intra-op thread each, M
micro-batches, ``checkpoint="never"`` and ``"always"``. Every configuration runs
in fresh processes (so peak memory is its own), configurations alternating,
``--repeats`` times. Besides ``pipe``'s four schedules it runs
``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleZBVZeroBubble``
on the same model, checkpointing with ``torch.utils.checkpoint`` around every
block, to count how often each engine runs a block's forward: every block
counts its calls, reported per micro-batch (1 = no recompute, 2 = recomputed
once).

It also times, in this process, the backward of one P5 stage (L/2 blocks, one
micro-batch of B/M rows at the smallest M) three ways: fused (one
``torch.autograd.backward``); split as ``pipe`` splits it (I, then W from
the recorded branch-node gradients, :mod:`pipe.core.iw_backward`); and
split naively (I, then ``torch.autograd.backward(outputs,
inputs=parameters)``, which walks the input path again).

The script prints, per M and checkpoint mode, samples/s of each engine and
schedule, the ratios against ``pipe`` 1F1B (and ``pipe`` against torch on the
same schedule), the peak resident memory each rank gained, and the forward
calls per block per micro-batch, and saves them to
benchmarks/results/zero_bubble.json.

Run:
    python benchmarks/zero_bubble.py              # W=1024 L=8 B=4096, M=4 and 8, 2 repeats: ~20 minutes
    python benchmarks/zero_bubble.py --quick      # W=256 B=512, M=4, 1 repeat: about two minutes
    python benchmarks/zero_bubble.py --split-only # only the cost of the split backward, seconds
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_vs_torch_pipelining import _rss_bytes
from action_profile import COMPUTE, instrument, report
from forked_ranks import run_forked_ranks

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: (engine, schedule) pairs; pipe's schedule names, torch's closest schedule classes.
#: "zbv-rule": pipe's runner on the rule-of-thumb ZB-V order (pipe.core.zero_bubble; what "zbv" ran before it
#: took the paper's V, which is torch's ZBV order), as a table, so that the two orders compare in one run.
RUNS: tuple[tuple[str, str], ...] = (
    ("pipe", "1f1b"), ("pipe", "interleaved"), ("pipe", "zb-h1"), ("pipe", "zbv"), ("pipe", "zbv-rule"),
    ("torch", "1f1b"), ("torch", "zbv"),
)
SAME_ORDER = {"zbv-rule": "zbv"}  # the torch schedule a pipe row is compared with, where names differ


class Counted(nn.Module):
    """A block that counts its forward calls (first forwards and recomputations alike)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.inner(x)


class TorchCheckpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block, as torch users checkpoint."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Counted(nn.Sequential(nn.Linear(width, width), nn.ReLU())) for _ in range(layers)])


def _pipe_step(rank: int, full: nn.Sequential, args: argparse.Namespace, x: Tensor, y: Tensor) -> Callable[[], None]:
    from pipe.distributed import DistributedPipe

    schedule: Any = args.schedule
    if args.schedule == "zbv-rule":
        from pipe.core.schedule_table import TableSchedule
        from pipe.core.zero_bubble import _v_rule

        schedule = TableSchedule.from_table([[f"{phase}{i}@{stage}" for phase, i, stage in program]
                                             for program in _v_rule(2, args.microbatches)], name="zbv-rule")
    pipe = DistributedPipe(full, chunks=args.microbatches, checkpoint=args.checkpoint, schedule=schedule,
                           virtual_stages=2 if args.schedule == "interleaved" else 1)

    def step() -> None:
        pipe.step(x, y, F.mse_loss)
        pipe.zero_grad(set_to_none=True)

    step.stats = pipe._runtime.transport.stats  # type: ignore[attr-defined]
    return step


def _torch_step(rank: int, full: nn.Sequential, args: argparse.Namespace, x: Tensor, y: Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    blocks = [TorchCheckpointed(b) if args.checkpoint == "always" else b for b in full]
    if args.schedule == "1f1b":
        half = len(blocks) // 2
        module = nn.Sequential(*(blocks[:half] if rank == 0 else blocks[half:]))
        stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        schedule: Any = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
        modules = [module]
        first, last = rank == 0, rank == 1
    else:  # the V: rank r holds stages r and 3 - r
        quarter = len(blocks) // 4
        chunks = [nn.Sequential(*blocks[s * quarter:(s + 1) * quarter]) for s in range(4)]
        mine = [rank, 3 - rank]
        stages = [PipelineStage(chunks[s], stage_index=s, num_stages=4, device=torch.device("cpu")) for s in mine]
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
        modules = [chunks[s] for s in mine]
        first = last = rank == 0

    def step() -> None:
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        for module in modules:
            module.zero_grad(set_to_none=True)

    return step


def _rank(rank: int, port: int, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    profile = instrument(args.engine) if args.profile else None
    before = _rss_bytes()
    full = model(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    step = (_pipe_step if args.engine == "pipe" else _torch_step)(rank, full, args, x, y)
    for _ in range(args.warmup):
        step()
    stats = getattr(step, "stats", None)
    if profile is not None:
        profile.clear()
        if stats is not None:
            stats.clear()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # The blocks this rank ran: a pipe rank materialises its own; a torch rank holds every block but runs its own.
    calls = [b.calls for b in full if isinstance(b, Counted) and b.calls > 0]
    per_microbatch = statistics.fmean(calls) / ((args.warmup + args.steps) * args.microbatches) if calls else 0.0
    result = {"rank": rank, "steps_per_s": args.steps / elapsed, "peak_gain_mb": (peak - before) / 2**20,
              "forwards_per_block_per_microbatch": per_microbatch}
    if profile is not None:
        result["profile"] = report(profile, args.steps, stats)
    results.put(result)
    dist.destroy_process_group()


def split_costs(args: argparse.Namespace, repeats: int = 7) -> dict[str, Any]:
    """Fastest seconds of a fused backward, of I + grouped W (pipe), and of I + naive W, for one stage."""
    from pipe.core.iw_backward import IWBackward

    torch.set_num_threads(1)
    stage = model(args.width, args.layers)[: args.layers // 2]
    rows = args.batch // min(args.microbatches)
    x = torch.randn(rows, args.width)
    grad = torch.randn(rows, args.width)
    params = list(stage.parameters())

    def fused() -> dict[str, float]:
        inp = x.clone().requires_grad_()
        out = stage(inp)
        start = time.perf_counter()
        out.backward(grad)
        return {"backward": time.perf_counter() - start}

    def split(naive: bool) -> dict[str, float]:
        inp = x.clone().requires_grad_()
        out = stage(inp)
        start = time.perf_counter()
        if naive:
            torch.autograd.grad(out, inp, grad, retain_graph=True)
            middle = time.perf_counter()
            torch.autograd.backward(out, grad, inputs=params)
        else:
            halves = IWBackward([out], [grad], [inp], params)
            halves.backward_input()
            middle = time.perf_counter()
            halves.backward_weight()
        end = time.perf_counter()
        return {"input": middle - start, "weight": end - middle, "backward": end - start}

    timings: dict[str, list[dict[str, float]]] = {"fused": [], "pipe_split": [], "naive_split": []}
    for _ in range(repeats):
        for name, run in (("fused", fused), ("pipe_split", lambda: split(False)), ("naive_split", lambda: split(True))):
            stage.zero_grad(set_to_none=True)
            timings[name].append(run())
    # The fastest run of each, one key at a time: on a shared machine the minimum is the least disturbed.
    result = {name: {key: min(t[key] for t in runs) for key in runs[0]} for name, runs in timings.items()}
    for name in ("pipe_split", "naive_split"):
        result[name]["vs_fused"] = result[name]["backward"] / result["fused"]["backward"]
    result["config"] = {"blocks": args.layers // 2, "rows": rows, "width": args.width, "repeats": repeats}
    return result


def worker(args: argparse.Namespace) -> None:
    """One engine and schedule on 2 ranks forked from this process; prints one JSON line."""
    print(json.dumps(run_forked_ranks(_rank, args)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (W=256, B=512, M=4), one repeat")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, alternating")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--split-only", action="store_true", help="only time the split backward of one stage")
    parser.add_argument("--profile", action="store_true",
                        help="also time each engine's actions, sends, receive waits and headers, per rank")
    parser.add_argument("--schedules", nargs="+", choices=sorted({s for _, s in RUNS}),
                        help="run only these schedules (both engines), e.g. --schedules zbv")
    parser.add_argument("--checkpoints", nargs="+", choices=["never", "always"], default=["never", "always"])
    parser.add_argument("--engine", choices=["pipe", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.microbatches, args.steps, args.repeats = 256, 512, [4], 5, 1
    if args.engine:
        args.microbatches = args.microbatches[0]
        worker(args)
        return
    if args.split_only:
        costs = split_costs(args)
        _print_split(costs)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"zero_bubble_split{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(costs, indent=2) + "\n")
        print(f"  saved {path.relative_to(HERE.parent)}")
        return

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    runs = [r for r in RUNS if not (args.no_torch and r[0] == "torch")
            and (args.schedules is None or r[1] in args.schedules)]
    configs = [(m, c) for m in args.microbatches for c in args.checkpoints]
    measured: dict[tuple[int, str, str, str], list[list[dict[str, float]]]] = {}
    for _ in range(args.repeats):
        for m, checkpoint in configs:
            for engine, schedule in runs:
                flags = ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
                         "--microbatches", str(m), "--steps", str(args.steps), "--warmup", str(args.warmup),
                         "--engine", engine, "--schedule", schedule, "--checkpoint", checkpoint]
                flags += ["--profile"] if args.profile else []
                done = subprocess.run([sys.executable, __file__, *flags], env=env, capture_output=True, text=True)
                key = (m, checkpoint, engine, schedule)
                if done.returncode != 0:
                    print(f"  {engine} {schedule} M={m} checkpoint={checkpoint} failed:\n{done.stderr[-2000:]}")
                    continue
                measured.setdefault(key, []).append(json.loads(done.stdout.strip().splitlines()[-1]))

    table = []
    for m, checkpoint in configs:
        rows: dict[str, Any] = {}
        for engine, schedule in runs:
            repeats = measured.get((m, checkpoint, engine, schedule))
            if not repeats:
                continue
            speeds = [min(r["steps_per_s"] for r in run) * args.batch for run in repeats]  # the slower rank
            rows[f"{engine} {schedule}"] = {
                "samples_per_s": statistics.median(speeds),
                "best_samples_per_s": max(speeds),  # the least disturbed run, on a shared machine
                "samples_per_s_runs": speeds,
                "peak_memory_gain_mb": [statistics.median(run[r]["peak_gain_mb"] for run in repeats) for r in (0, 1)],
                "forwards_per_block_per_microbatch": statistics.fmean(
                    statistics.fmean(r["forwards_per_block_per_microbatch"] for r in run) for run in repeats),
                "ratio_runs": speeds,
            }
            if args.profile:  # the last repeat's, per rank, and the step no schedule can beat on its compute
                profiles = [r.get("profile") or {} for r in repeats[-1]]
                rows[f"{engine} {schedule}"].update(
                    profile=profiles, step_ms_last_repeat=1e3 / min(r["steps_per_s"] for r in repeats[-1]),
                    no_bubble_step_ms=max(sum(profile.get(name, {}).get("ms_per_step", 0.0) for name in COMPUTE[engine])
                                          for profile in profiles))
        for stat, suffix in (("samples_per_s", ""), ("best_samples_per_s", "_best")):
            base = rows.get("pipe 1f1b", {}).get(stat)
            for name, row in rows.items():
                row["vs_pipe_1f1b" + suffix] = row[stat] / base if base else None
                peer = f"torch {SAME_ORDER.get(name[5:], name[5:])}"
                if name.startswith("pipe ") and peer in rows:
                    row["vs_torch_same_schedule" + suffix] = row[stat] / rows[peer][stat]
                    if args.profile and not suffix:  # torch's step over the busier rank's compute, whichever is less
                        row["ceiling_vs_torch"] = rows[peer]["step_ms_last_repeat"] / min(
                            row["no_bubble_step_ms"], rows[peer]["no_bubble_step_ms"])
        table.append({"microbatches": m, "checkpoint": checkpoint, "runs": rows})

    result = {
        "config": {"width": args.width, "layers": args.layers, "batch": args.batch, "ranks": 2,
                   "threads_per_rank": 1, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                   "quick": args.quick, "torch_checkpoint": "torch.utils.checkpoint around every block",
                   "pipe_checkpoint": "checkpoint='always' (every stage cell)"},
        "table": table,
        "split_backward": split_costs(args),
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(f"zero bubble (W={args.width} L={args.layers} B={args.batch}, 2 ranks x 1 thread, "
          f"{args.steps} steps, median and best of {args.repeats}):")
    for entry in table:
        print(f"  M={entry['microbatches']} checkpoint={entry['checkpoint']}")
        for name, row in entry["runs"].items():
            versus, best = row.get("vs_torch_same_schedule"), row.get("vs_torch_same_schedule_best")
            print(f"    {name:18s} {row['samples_per_s']:6.0f} samples/s (best {row['best_samples_per_s']:.0f})"
                  f"  x{row['vs_pipe_1f1b'] or 0:.2f} (best x{row['vs_pipe_1f1b_best'] or 0:.2f}) of pipe 1f1b"
                  + (f"  x{versus:.2f} (best x{best:.2f}) of torch" if versus and best else "")
                  + f"  peak +{row['peak_memory_gain_mb'][0]:.0f}/{row['peak_memory_gain_mb'][1]:.0f} MB"
                  + f"  forwards/block/micro-batch {row['forwards_per_block_per_microbatch']:.2f}")
            if "ceiling_vs_torch" in row:
                print(f"      no schedule and no runtime beats torch by more than x{row['ceiling_vs_torch']:.3f} "
                      f"(torch's step {entry['runs'][f'torch {SAME_ORDER.get(name[5:], name[5:])}']['step_ms_last_repeat']:.0f} ms; "
                      f"the busier rank's compute {row['no_bubble_step_ms']:.0f} ms)")
            for rank, profile in enumerate(row.get("profile") or []):
                print(f"      rank {rank} ms/step: " + ", ".join(
                    f"{key} {value['ms_per_step']:.1f} ({value['calls_per_step']:g})"
                    for key, value in (profile or {}).items() if isinstance(value, dict) and "ms_per_step" in value)
                      + "".join(f"; {key} {value}" for key, value in (profile or {}).items()
                                if isinstance(value, dict) and "ms_per_step" not in value))
    print(f"  load average {result['load_average'][0]:.2f}")
    _print_split(result["split_backward"])
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"zero_bubble{'-quick' if args.quick else ''}{'-profile' if args.profile else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  saved {path.relative_to(HERE.parent)}")


def _print_split(costs: dict[str, Any]) -> None:
    c = costs["config"]
    print(f"  backward of one stage ({c['blocks']} blocks, {c['rows']} rows, W={c['width']}), fastest of {c['repeats']}:")
    print(f"    fused              {costs['fused']['backward'] * 1e3:7.1f} ms")
    for name, label in (("pipe_split", "I + W (pipe)"), ("naive_split", "I + W (naive)")):
        row = costs[name]
        print(f"    {label:18s} {row['backward'] * 1e3:7.1f} ms = I {row['input'] * 1e3:.1f} + W {row['weight'] * 1e3:.1f}"
              f"  ({row['vs_fused']:.2f}x fused)")


if __name__ == "__main__":
    main()
