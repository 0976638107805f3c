"""Zero-bubble schedules: step time of 1F1B, interleaved 1F1B, ZB-H1 and ZB-V, with and without checkpointing.

The P5 model (a stack of L Linear+ReLU blocks of width W, B-row batches, MSE
loss) on 2 gloo ranks of this machine (``--ranks 4``: 4), one intra-op thread each, M
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
    python benchmarks/zero_bubble.py --repeats 3 --ranks 4 --microbatches 4  # auto_vs_torch_best_4

``pipe auto`` is the order and cut of ``pipe.plan.calibrated_schedule``: from the layers' F, I and W
timed on rank 0 in the same run, then from the medians of a step of that order recorded on the ranks
(``--auto-rounds``, default 2; 0 orders by the layer times alone). Peak memory is each rank's highest
resident set during its steps, over what it held before it built the model: the peak is reset after building
(``/proc/self/clear_refs``), so auto's layer timing and trial steps, on a copy of the model, are not counted.
``pipe auto-layers`` is the same from the layer times alone, to compare in one run
(``--schedules zbv auto auto-layers``). The JSON's ``auto_*`` keys are its ratios against torch's fastest schedule, against
the busiest rank's own compute (``auto_of_bound``), and the worst error of its simulated step. After the timed
steps of an auto order, 2 more are recorded (``pipe.trace.record``) and each run's ``cost_errors`` names the costs
the order was simulated with that lie furthest from the recorded medians (``TracedStep.cost_errors``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
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
#: "auto": pipe.plan.calibrated_schedule's cut and order, at 1F1B's peak memory (its default limit);
#: "auto-layers": the same from the layers' F, I and W timed on rank 0 alone (no recorded step, rounds=0).
RUNS: tuple[tuple[str, str], ...] = (
    ("pipe", "1f1b"), ("pipe", "interleaved"), ("pipe", "zb-h1"), ("pipe", "zbv"), ("pipe", "zbv-rule"),
    ("pipe", "auto"), ("pipe", "auto-layers"), ("torch", "1f1b"), ("torch", "zbv"),
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


def _auto(full: nn.Sequential, args: argparse.Namespace, x: Tensor, y: Tensor
          ) -> tuple[Any, list[int], dict[str, Any], Any]:
    """The cut and the order of pipe.plan.calibrated_schedule: rank 0 times the layers and chooses, every
    rank runs a recorded step of that order on a copy of the model, rank 0 chooses again by the step's costs
    (``--auto-rounds`` times); every rank gets its choice."""
    from pipe.plan import calibrated_schedule

    auto = calibrated_schedule(full, x, y, chunks=args.microbatches, loss_fn=F.mse_loss, checkpoint=args.checkpoint,
                               rounds=args.auto_rounds if args.schedule == "auto" else 0, timeout=args.auto_timeout,
                               action_seconds=None if args.auto_action_us is None else args.auto_action_us * 1e-6)
    chosen = {"name": auto.schedule.name, "balance": auto.balance, "simulated_step_s": auto.step,
              "bound_step_s": auto.bound, "placement": list(auto.schedule.placement),
              "recorded_step_s": auto.measured[-1].wall if auto.measured else None,
              "overhead_per_action_us": auto.costs.overhead * 1e6, "costs": dataclasses.asdict(auto.costs),
              "table_csv": auto.schedule.to_csv()}
    return auto.schedule, auto.balance, chosen, auto.costs


def _pipe_step(rank: int, full: nn.Sequential, args: argparse.Namespace, x: Tensor, y: Tensor) -> Callable[[], None]:
    from pipe.distributed import DistributedPipe

    schedule: Any = args.schedule
    balance, chosen, costs = None, None, None
    if args.schedule == "zbv-rule":
        from pipe.core.schedule_table import TableSchedule
        from pipe.core.zero_bubble import _v_rule

        schedule = TableSchedule.from_table(_v_rule(args.ranks, args.microbatches), name="zbv-rule")
    elif args.schedule in ("auto", "auto-layers"):
        schedule, balance, chosen, costs = _auto(full, args, x, y)
    pipe = DistributedPipe(full, chunks=args.microbatches, checkpoint=args.checkpoint, schedule=schedule,
                           balance=balance, virtual_stages=2 if args.schedule == "interleaved" else 1)

    def step() -> None:
        pipe.step(x, y, F.mse_loss)
        pipe.zero_grad(set_to_none=True)

    step.stats = pipe._runtime.transport.stats  # type: ignore[attr-defined]
    step.auto = chosen  # type: ignore[attr-defined]
    step.costs, step.balance = costs, balance  # type: ignore[attr-defined]
    return step


def _cost_errors(rank: int, step: Callable[[], None], recorded_steps: int = 2) -> None:
    """After the timed steps of an auto order: ``recorded_steps`` more, recorded on every rank, and on rank 0 the
    costs the order was simulated with against the recorded medians, the largest difference first (which
    action's cost was wrong), into ``step.auto``."""
    from pipe import trace
    from pipe.balance import traced_step

    with trace.record(None, rank=rank) as recorder:
        for _ in range(recorded_steps):
            step()
    traces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(traces, recorder.trace())
    if rank == 0:
        recorded = traced_step(traces, balance=step.balance)  # type: ignore[attr-defined]
        step.auto["recorded_after_s"] = recorded.wall  # type: ignore[attr-defined]
        step.auto["cost_errors"] = [str(e) for e in recorded.cost_errors(step.costs)[:3]]  # type: ignore[attr-defined]


def _torch_step(rank: int, full: nn.Sequential, args: argparse.Namespace, x: Tensor, y: Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    blocks = [TorchCheckpointed(b) if args.checkpoint == "always" else b for b in full]
    p = args.ranks
    if args.schedule == "1f1b":
        share = len(blocks) // p
        module = nn.Sequential(*blocks[rank * share:(rank + 1) * share])
        stage = PipelineStage(module, stage_index=rank, num_stages=p, device=torch.device("cpu"))
        schedule: Any = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
        modules = [module]
        first, last = rank == 0, rank == p - 1
    else:  # the V: rank r holds stages r and 2p - 1 - r
        share = len(blocks) // (2 * p)
        chunks = [nn.Sequential(*blocks[s * share:(s + 1) * share]) for s in range(2 * p)]
        mine = [rank, 2 * p - 1 - rank]
        stages = [PipelineStage(chunks[s], stage_index=s, num_stages=2 * p, device=torch.device("cpu")) for s in mine]
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


def _forget_peak() -> None:
    """Lowers the process's peak resident memory to what it holds now (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    """The process's peak resident memory since :func:`_forget_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rank(rank: int, port: int, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks, timeout=datetime.timedelta(seconds=600))
    profile = instrument(args.engine) if args.profile else None
    before = _rss_bytes()
    full = model(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    step = (_pipe_step if args.engine == "pipe" else _torch_step)(rank, full, args, x, y)
    _forget_peak()  # the peak of the steps, not of choosing the order (auto's layer timing and trial steps)
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
    peak = _peak_bytes()
    # The blocks this rank ran: a pipe rank materialises its own; a torch rank holds every block but runs its own.
    calls = [b.calls for b in full if isinstance(b, Counted) and b.calls > 0]
    per_microbatch = statistics.fmean(calls) / ((args.warmup + args.steps) * args.microbatches) if calls else 0.0
    result = {"rank": rank, "steps_per_s": args.steps / elapsed, "peak_gain_mb": (peak - before) / 2**20,
              "forwards_per_block_per_microbatch": per_microbatch}
    if profile is not None:
        result["profile"] = report(profile, args.steps, stats)
    if getattr(step, "auto", None) is not None:  # after counting the blocks' calls: these steps are extra
        _cost_errors(rank, step)
        result["auto"] = step.auto  # type: ignore[attr-defined]
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
    """One engine and schedule on ``--ranks`` ranks forked from this process; prints one JSON line."""
    print(json.dumps(run_forked_ranks(_rank, args, ranks=args.ranks)))


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
    parser.add_argument("--output", type=Path, default=None, help="the JSON file (default: benchmarks/results/...)")
    parser.add_argument("--profile", action="store_true",
                        help="also time each engine's actions, sends, receive waits and headers, per rank")
    parser.add_argument("--schedules", nargs="+", choices=sorted({s for _, s in RUNS}),
                        help="run only these schedules (both engines), e.g. --schedules zbv")
    parser.add_argument("--checkpoints", nargs="+", choices=["never", "always"], default=["never", "always"])
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (processes), 2 or 4")
    parser.add_argument("--auto-timeout", type=float, default=2.0,
                        help="seconds rank 0 times the layers for the auto schedule")
    parser.add_argument("--auto-action-us", type=float, default=None,
                        help="microseconds the runner adds per action, for the auto schedule's costs (default: "
                             "measured in the recorded step; 0 without --auto-rounds)")
    parser.add_argument("--auto-rounds", type=int, default=2,
                        help="trial runs the auto order is calibrated by, each 3 recorded steps (0: the layer "
                             "times alone)")
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
                         "--engine", engine, "--schedule", schedule, "--checkpoint", checkpoint,
                         "--ranks", str(args.ranks), "--auto-timeout", str(args.auto_timeout),
                         "--auto-rounds", str(args.auto_rounds)]
                flags += ["--auto-action-us", str(args.auto_action_us)] if args.auto_action_us is not None else []
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
            if schedule in ("auto", "auto-layers"):  # what rank 0 chose, and the step it predicted, per repeat
                chosen = [run[0].get("auto", {}) for run in repeats]
                measured_s = [1 / min(r["steps_per_s"] for r in run) for run in repeats]
                rows[f"pipe {schedule}"].update(
                    chosen=[{k: c.get(k) for k in ("name", "balance", "placement", "recorded_step_s",
                                                   "overhead_per_action_us", "costs", "table_csv",
                                                   "recorded_after_s", "cost_errors")}
                            for c in chosen],
                    simulated_step_s=[c.get("simulated_step_s") for c in chosen], measured_step_s=measured_s,
                    prediction_error=[c["simulated_step_s"] / t - 1 for c, t in zip(chosen, measured_s)],
                    of_bound=statistics.median(c["bound_step_s"] / t for c, t in zip(chosen, measured_s)))
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
        torch_best = max((row["samples_per_s"] for name, row in rows.items() if name.startswith("torch ")),
                         default=None)
        for name in ("pipe auto", "pipe auto-layers"):
            if name in rows and torch_best:
                rows[name]["vs_torch_best"] = rows[name]["samples_per_s"] / torch_best
        table.append({"microbatches": m, "checkpoint": checkpoint, "runs": rows})

    result = {
        "config": {"width": args.width, "layers": args.layers, "batch": args.batch, "ranks": args.ranks,
                   "threads_per_rank": 1, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                   "quick": args.quick, "torch_checkpoint": "torch.utils.checkpoint around every block",
                   "pipe_checkpoint": "checkpoint='always' (every stage cell)"},
        "table": table,
        "split_backward": split_costs(args),
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    result.update(_auto_keys(table, args.ranks))
    print(f"zero bubble (W={args.width} L={args.layers} B={args.batch}, {args.ranks} ranks x 1 thread, "
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
            for k, (error, chosen) in enumerate(zip(row.get("prediction_error", []), row.get("chosen", []))):
                print(f"      run {k}: simulated / measured step {error:+.1%}, {chosen['name']}; the costs furthest "
                      f"from a recorded step after it: " + "; ".join(chosen.get("cost_errors") or ["none recorded"]))
            for rank, profile in enumerate(row.get("profile") or []):
                print(f"      rank {rank} ms/step: " + ", ".join(
                    f"{key} {value['ms_per_step']:.1f} ({value['calls_per_step']:g})"
                    for key, value in (profile or {}).items() if isinstance(value, dict) and "ms_per_step" in value)
                      + "".join(f"; {key} {value}" for key, value in (profile or {}).items()
                                if isinstance(value, dict) and "ms_per_step" not in value))
    for key, value in result.items():
        if key.startswith("auto_"):
            print(f"  {key} {value:.3f}" if isinstance(value, float) else f"  {key} {value}")
    print(f"  load average {result['load_average'][0]:.2f}")
    _print_split(result["split_backward"])
    RESULTS.mkdir(exist_ok=True)
    path = args.output or RESULTS / (f"zero_bubble{'-quick' if args.quick else ''}{'-profile' if args.profile else ''}"
                                     f"{f'-{args.ranks}ranks' if args.ranks != 2 else ''}.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  saved {path}")


def _auto_keys(table: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """The issue's figures of the auto order: auto / torch's fastest schedule (M=4 and 8, checkpoint never and
    always; ``_4`` with 4 ranks), auto / the bound (the busiest rank's own compute from the timed costs), and the
    worst |simulated / measured step - 1| over the auto runs."""
    keys: dict[str, Any] = {}
    for entry in table:
        auto = entry["runs"].get("pipe auto")
        if not auto or auto.get("vs_torch_best") is None:
            continue
        m, checkpoint = entry["microbatches"], entry["checkpoint"]
        suffix = ("" if m == 4 else f"_m{m}") + ("" if checkpoint == "never" else "_ckpt") + ("" if ranks == 2
                                                                                            else f"_{ranks}")
        keys["auto_vs_torch_best" + suffix] = auto["vs_torch_best"]
        if m == 4 and checkpoint == "never":
            keys["auto_of_bound" + ("" if ranks == 2 else f"_{ranks}")] = auto["of_bound"]
    for name, key in (("pipe auto", "auto_prediction_error_worst"),
                      ("pipe auto-layers", "auto_layers_prediction_error_worst")):
        errors = [abs(e) for entry in table for e in entry["runs"].get(name, {}).get("prediction_error", [])]
        if errors:
            keys[key] = max(errors)
    return keys


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
