"""How steady this machine's speed is: the planner benchmark's reference computation, timed back to back.

`python benchmarks/planner.py budget` times a fixed computation (`reference()`) around each
plan, since the machine switches between two speeds (docs/planner.md, *The
machine's two speeds*). This script times the same computation for 20 s in
one process, then for 20 s in two processes at once, as the benchmark's two
ranks run, twice over. It reports the fastest and the median, and how often
each run came within 10% of the fastest that one process saw (the
benchmark's `QUIET`): the share of time the machine spends in its fast state;
and the CPU time each run took over its wall time (1 where the core ran it
throughout: a slow run at 1 is a slower core, one under 1 a process kept
waiting).

Then (`paired`) it times 60 steps of one plan of the planner benchmark's
transformer on 2 gloo ranks, with the reference on both ranks right before and
after each step: whether a step's time follows the reference's, that is
whether scaling a step by the reference around it would take the machine's
speed out of the measurement.

Run:
    python benchmarks/planner.py machine             # about 2 minutes; nothing else should run
Results: printed, and saved to benchmarks/results/machine_speed.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
sys.path.insert(0, str(HERE))

from pipe.distributed.local_ranks import run_local_ranks  # noqa: E402
from planner_bench.budget import MODELS, QUIET, SIZES, build_pipe, is_quiet, reference  # noqa: E402

from pipe.plan import Candidate  # noqa: E402

PAIRED = ("transformer", Candidate("1f1b", 4, (3, 3), "never"))
"""The model and plan of the paired probe (the planner benchmark's transformer, 4 micro-batches of 4 sequences)."""


Series = tuple[list[float], list[float]]


def series(seconds: float, results: "multiprocessing.Queue[Series] | None" = None) -> Series:
    """Back-to-back references (50 ms apart) for ``seconds``; and for each call of :func:`reference`, the
    CPU time this thread spent in it over its wall time (1 where the core ran it all along: a slow reference
    then means a slow core, not a process kept waiting)."""
    torch.set_num_threads(1)
    times: list[float] = []
    busy: list[float] = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        wall, cpu = time.perf_counter(), time.thread_time()
        times.append(reference())
        busy.append((time.thread_time() - cpu) / (time.perf_counter() - wall))
        time.sleep(0.05)
    if results is not None:
        results.put((times, busy))
    return times, busy


def summary(run: Series, fastest: float) -> dict[str, Any]:
    times, busy = run
    slow = [b for t, b in zip(times, busy) if not is_quiet(t, fastest)]
    return {"count": len(times), "fastest_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "fast_share": sum(is_quiet(t, fastest) for t in times) / len(times),
            "cpu_over_wall_median": statistics.median(busy),
            "cpu_over_wall_median_slow": statistics.median(slow) if slow else None}


def _paired_rank(rank: int, world: int, rounds: int) -> list[list[float]]:
    name, plan = PAIRED
    build, data, loss_fn = MODELS[name]
    x, y = data(SIZES["full"][name])
    model = build_pipe(build, SIZES["full"][name], plan)
    for _ in range(2):
        model.step(x, y, loss_fn)  # warm-up
    timed = torch.zeros(3, rounds, dtype=torch.float64)  # per round: the step, the references before and after
    for k in range(rounds):
        dist.barrier()  # both ranks time the reference together, as they run the step
        before = reference()
        dist.barrier()
        begun = time.perf_counter()
        model.step(x, y, loss_fn)
        step = time.perf_counter() - begun
        dist.barrier()
        timed[0, k], timed[1, k], timed[2, k] = step, before, reference()
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # the slower rank's
    return list(timed.tolist())


def paired(rounds: int) -> dict[str, Any]:
    """Steps of :data:`PAIRED` on 2 gloo ranks with the reference around each: how closely they move together."""
    steps, before, after = run_local_ranks(_paired_rank, 2, rounds, timeout=300.0, deadline=600.0,
                                           start_method="fork")[0]  # the slower rank's, on both
    around = [(b + a) / 2 for b, a in zip(before, after)]
    fastest = min(before + after)
    scaled = [s * fastest / r for s, r in zip(steps, around)]

    def spread(values: list[float]) -> dict[str, float]:
        return {"fastest_ms": min(values) * 1e3, "median_ms": statistics.median(values) * 1e3,
                "cv": statistics.pstdev(values) / statistics.fmean(values)}

    return {"plan": f"{PAIRED[0]}: {PAIRED[1].describe()}", "rounds": rounds, "step": spread(steps),
            "reference": spread(around), "step_scaled_by_reference": spread(scaled),
            "correlation": statistics.correlation(steps, around)}


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each series (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one, then two processes (default 2)")
    parser.add_argument("--steps", type=int, default=60, help="steps of the paired probe (default 60)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (a correlation over the steps), got {args.steps}")
    context = multiprocessing.get_context("fork")
    rounds = []
    for number in range(args.rounds):
        alone = series(args.seconds)
        queue: "multiprocessing.Queue[Series]" = context.Queue()
        processes = [context.Process(target=series, args=(args.seconds, queue)) for _ in range(2)]
        for process in processes:
            process.start()
        both = [queue.get(timeout=args.seconds + 60) for _ in processes]
        for process in processes:
            process.join()
        fastest = min(alone[0])
        row: dict[str, Any] = {"one_process": summary(alone, fastest), "two_processes": [summary(b, fastest) for b in both]}
        rounds.append(row)
        one = row["one_process"]
        print(f"round {number + 1}: one process: fastest {one['fastest_ms']:.2f} ms, median {one['median_ms']:.2f} ms, "
              f"fast {one['fast_share']:.0%}, CPU time over wall time {one['cpu_over_wall_median']:.3f} at the median; "
              "two at once: " + "; ".join(f"median {r['median_ms']:.2f} ms, fast {r['fast_share']:.0%}, CPU over wall "
                                          f"{r['cpu_over_wall_median']:.3f}" for r in row["two_processes"]),
              flush=True)
    pair = paired(args.steps)
    print(f"paired: {pair['plan']}, {pair['rounds']} steps with the reference around each: step median "
          f"{pair['step']['median_ms']:.2f} ms (cv {pair['step']['cv']:.3f}), reference median "
          f"{pair['reference']['median_ms']:.2f} ms (cv {pair['reference']['cv']:.3f}); correlation "
          f"{pair['correlation']:.2f}; the step scaled by its reference: cv {pair['step_scaled_by_reference']['cv']:.3f}")
    out = HERE / "results" / "machine_speed.json"
    out.write_text(json.dumps({"quiet": QUIET, "seconds": args.seconds, "rounds": rounds, "paired": pair,
                               "torch": torch.__version__}, indent=2))
    print(f"wrote {out}")

