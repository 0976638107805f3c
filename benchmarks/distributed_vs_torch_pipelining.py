"""P5: the multi-process pipeline against torch.distributed.pipelining, same model, ranks, schedule, micro-batches.

Both engines train the same stack of Linear+ReLU layers (width W, L layers,
balance L/2 per rank) on 2 gloo ranks on this machine, one intra-op thread
each, with a 1F1B schedule, M micro-batches of a B-row batch, no activation
checkpointing, and an MSE loss. Each engine runs in fresh processes (so that
peak memory is its own), alternating engine by engine ``--repeats`` times; the
script prints the throughput ratio (pipe / torch, higher is better) and the
ratio of the peak resident memory each rank gained over the run (pipe / torch,
lower is better; glibc's MALLOC_MMAP_THRESHOLD_=65536 makes freed activations
leave RSS), and saves them to benchmarks/results/.

``--overhead`` measures the fixed cost of an action instead: a tiny model
(W=32, L=2, one row per micro-batch, M=16), where compute is nearly nothing,
so a step's time over the 2M actions of a rank is what each runtime spends per
action around the compute (Python, bookkeeping, messages). It reports
microseconds per action per engine (key ``overhead_us_per_action``).
``--baseline DIR`` also runs ``pipe`` from another checkout (``PYTHONPATH=DIR``,
e.g. the main branch's) in the same alternation, as engine ``pipe-baseline``.

Run:
    python benchmarks/distributed_vs_torch_pipelining.py            # W=1024 L=8 B=4096 M=8, a few minutes
    python benchmarks/distributed_vs_torch_pipelining.py --quick    # W=256 B=512, seconds
    python benchmarks/distributed_vs_torch_pipelining.py --overhead # W=32 B=16 M=16, 7 repeats, about 3 minutes
    python benchmarks/distributed_vs_torch_pipelining.py --overhead --quick --baseline /path/to/main  # seconds
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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from action_profile import COMPUTE, instrument, report
from forked_ranks import run_forked_ranks

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, port: int, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    profile = instrument(args.engine) if args.profile else None
    before = _rss_bytes()
    full = model(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    half = args.layers // 2
    if args.engine == "pipe":
        from pipe.distributed import DistributedPipe

        pipe = DistributedPipe(full, chunks=args.microbatches, checkpoint="never", schedule="1f1b",
                               balance=[half, args.layers - half])
        del full

        def step() -> None:
            pipe.step(x, y, F.mse_loss)
            pipe.zero_grad(set_to_none=True)
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        submodule = full[:half] if rank == 0 else full[half:]
        del full
        stage = PipelineStage(submodule, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            submodule.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    stats = pipe._runtime.transport.stats if args.engine == "pipe" else None
    if profile is not None:
        profile.clear()
        if stats is not None:
            stats.clear()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    times = []
    for _ in range(args.steps):
        begun = time.perf_counter()
        step()
        times.append(time.perf_counter() - begun)
    dist.barrier()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rank": rank, "steps_per_s": args.steps / elapsed, "peak_gain_mb": (peak - before) / 2**20,
              "median_step_s": statistics.median(times), "cpu_s_per_step": cpu / args.steps}
    if profile is not None:
        result["profile"] = report(profile, args.steps, stats)
    results.put(result)
    dist.destroy_process_group()


def bound(profiles: dict[str, list[Any]], runs: dict[str, list[list[dict[str, float]]]],
          microbatches: int) -> dict[str, Any]:
    """The fastest step any runtime could take on 1F1B with the compute each engine measured per action.

    Each rank's forward and backward per micro-batch are its profile's means, laid out by pipe's schedule
    simulator with free messages and no work between actions (pipe.core.program_time.time_schedule).
    Against torch's measured step (the slower rank's median), this is the ceiling of pipe / torch on this
    schedule: whatever a runtime saves, the compute and the fill and drain stay.
    """
    from pipe.core.program_time import time_schedule
    from pipe.core.action import Phase
    from pipe.core.schedule import Schedule

    schedule = Schedule("1f1b", ranks=2, microbatches=microbatches)
    ideal = {}
    for engine in ("pipe", "torch"):
        forward, backward, _ = COMPUTE[engine]  # pipe's include posting the sends
        per_action = [{Phase.FORWARD: rank[forward]["ms_per_step"] / rank[forward]["calls_per_step"],
                       Phase.BACKWARD: rank[backward]["ms_per_step"] / rank[backward]["calls_per_step"]}
                      for rank in profiles[engine]]
        timed = time_schedule(schedule, lambda action, per_action=per_action:
                              per_action[action.stage].get(action.phase, 0.0))
        ideal[engine] = max(t.end for t in timed)
    measured = {engine: 1e3 * max(r["median_step_s"] for r in runs[engine][-1]) for engine in ("pipe", "torch")}
    return {"ideal_step_ms": ideal, "measured_step_ms": measured,
            "ceiling_pipe_over_torch": measured["torch"] / min(ideal.values())}


def worker(args: argparse.Namespace) -> None:
    """One engine, 2 ranks forked from this process; prints one JSON line."""
    print(json.dumps(run_forked_ranks(_rank, args)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (W=256, B=512), seconds")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="runs per engine, alternating (default 2; --quick 1, --overhead 7)")
    parser.add_argument("--profile", action="store_true",
                        help="also time each engine's actions, sends, receives and headers (benchmarks/action_profile.py)")
    parser.add_argument("--overhead", action="store_true",
                        help="the fixed cost per action: W=32 L=2 B=16 M=16, microseconds per action per engine")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run pipe from this checkout (PYTHONPATH=DIR), as engine pipe-baseline")
    parser.add_argument("--engine", choices=["pipe", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeats = args.repeats
    if args.overhead and not args.engine:
        args.width, args.layers, args.batch, args.microbatches = 32, 2, 16, 16
        args.steps, args.warmup, args.repeats = (30, 5, 2) if args.quick else (60, 10, 7)
    elif args.quick:
        args.width, args.batch, args.steps, args.warmup, args.repeats = 256, 512, 5, 1, 1
    args.repeats = repeats or args.repeats or 2
    if args.engine:
        worker(args)
        return

    engines = ["pipe", "torch"] + (["pipe-baseline"] if args.baseline else [])
    runs: dict[str, list[list[dict[str, float]]]] = {engine: [] for engine in engines}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    flags = ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
             "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    flags += ["--profile"] if args.profile else []
    for _ in range(args.repeats):
        for engine in engines:
            engine_env = env
            if engine == "pipe-baseline":
                engine_env = dict(env, PYTHONPATH=os.pathsep.join([args.baseline, env.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, __file__, "--engine", engine.split("-")[0], *flags],
                                 env=engine_env, check=True, capture_output=True, text=True).stdout
            runs[engine].append(json.loads(out.strip().splitlines()[-1]))

    def throughput(engine: str) -> float:  # samples/s of the slower rank, median over repeats
        return statistics.median(min(r["steps_per_s"] for r in run) for run in runs[engine]) * args.batch

    def memory(engine: str, rank: int) -> float:
        return statistics.median(run[rank]["peak_gain_mb"] for run in runs[engine])

    actions = 2 * args.microbatches  # per rank per step: one stage each, a forward and a backward per micro-batch

    def us_per_action(run: list[dict[str, float]]) -> float:  # the slower rank's median step over its actions
        return 1e6 * max(r["median_step_s"] for r in run) / actions  # (the median: other jobs' bursts out)

    result: dict[str, Any] = {
        "figure": "P5-overhead" if args.overhead else "P5",
        "config": {"width": args.width, "layers": args.layers, "batch": args.batch,
                   "microbatches": args.microbatches, "ranks": 2, "threads_per_rank": 1, "schedule": "1f1b",
                   "checkpoint": "never", "steps": args.steps, "repeats": args.repeats, "quick": args.quick,
                   "baseline": args.baseline},
        "samples_per_s": {engine: throughput(engine) for engine in runs},
        "throughput_ratio_pipe_over_torch": throughput("pipe") / throughput("torch"),
        "peak_memory_gain_mb": {engine: [memory(engine, rank) for rank in (0, 1)] for engine in runs},
        "memory_ratio_pipe_over_torch": [memory("pipe", rank) / memory("torch", rank) for rank in (0, 1)],
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    ratios = [min(p["steps_per_s"] for p in pipe_run) / min(t["steps_per_s"] for t in torch_run)
              for pipe_run, torch_run in zip(runs["pipe"], runs["torch"])]
    result["ratio_per_repeat"] = ratios
    if args.baseline:
        result["throughput_ratio_pipe_over_baseline"] = throughput("pipe") / throughput("pipe-baseline")
        result["throughput_ratio_baseline_over_torch"] = throughput("pipe-baseline") / throughput("torch")
    if args.overhead:
        result["overhead_us_per_action"] = {engine: statistics.median(us_per_action(run) for run in runs[engine])
                                            for engine in engines}
        result["overhead_us_per_action_per_repeat"] = {engine: [us_per_action(run) for run in runs[engine]]
                                                       for engine in engines}
        result["overhead_us_per_action_fastest_repeat"] = {
            engine: min(result["overhead_us_per_action_per_repeat"][engine]) for engine in engines}
        # CPU time (all threads of the rank's process, gloo's included) per action: what a runtime burns around
        # the compute, much less sensitive to other jobs than wall time. The busier rank's, median over repeats.
        result["overhead_cpu_us_per_action"] = {
            engine: statistics.median(1e6 * max(r["cpu_s_per_step"] for r in run) / actions for run in runs[engine])
            for engine in engines}
    if args.profile:  # the last repeat's, per rank
        result["profile"] = {engine: [rank.get("profile") for rank in runs[engine][-1]] for engine in runs}
        result["bound"] = bound(result["profile"], runs, args.microbatches)
    print(f"P5 (W={args.width} L={args.layers} B={args.batch} M={args.microbatches}, 2 ranks x 1 thread, 1F1B):")
    print(f"  throughput pipe / torch.distributed.pipelining: {result['throughput_ratio_pipe_over_torch']:.3f} "
          f"({result['samples_per_s']['pipe']:.0f} vs {result['samples_per_s']['torch']:.0f} samples/s; target >= 1)")
    print("  peak memory gain per rank pipe / torch: "
          + ", ".join(f"rank {r}: {ratio:.3f}" for r, ratio in enumerate(result["memory_ratio_pipe_over_torch"]))
          + " (target <= 1)")
    print(f"  per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; load average {result['load_average'][0]:.2f}")
    if args.baseline:
        print(f"  pipe / pipe-baseline ({args.baseline}): {result['throughput_ratio_pipe_over_baseline']:.3f}; "
              f"pipe-baseline / torch: {result['throughput_ratio_baseline_over_torch']:.3f}")
    if args.overhead:
        print("  microseconds per action (median step / 2M actions; median over repeats, then each): " + ", ".join(
            f"{engine} {us:.0f} ({'/'.join(f'{v:.0f}' for v in result['overhead_us_per_action_per_repeat'][engine])})"
            for engine, us in result["overhead_us_per_action"].items()))
        print("  fastest repeat: " + ", ".join(
            f"{engine} {us:.0f}" for engine, us in result["overhead_us_per_action_fastest_repeat"].items()))
        print("  CPU microseconds per action (busier rank, median over repeats): " + ", ".join(
            f"{engine} {us:.0f}" for engine, us in result["overhead_cpu_us_per_action"].items()))
    if args.profile:
        b = result["bound"]
        print(f"  1F1B with free messages and no runtime work, on the compute each engine measured: "
              f"{b['ideal_step_ms']['pipe']:.0f} ms (pipe's compute), {b['ideal_step_ms']['torch']:.0f} ms (torch's); "
              f"torch measured {b['measured_step_ms']['torch']:.0f} ms, pipe {b['measured_step_ms']['pipe']:.0f} ms: "
              f"no runtime can beat torch by more than {b['ceiling_pipe_over_torch']:.3f}x on this schedule")
        for engine in runs:
            for rank, profile in enumerate(result["profile"][engine]):
                print(f"  {engine} rank {rank} ms/step: " + ", ".join(
                    f"{name} {value['ms_per_step']:.1f} ({value['calls_per_step']:g})" if "ms_per_step" in value
                    else f"{name} {value}" for name, value in profile.items() if isinstance(value, dict)))
    RESULTS.mkdir(exist_ok=True)
    name = "distributed_vs_torch_pipelining" + "-overhead" * args.overhead + "-quick" * args.quick
    path = RESULTS / f"{name}{'-profile' if args.profile else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  saved {path.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
