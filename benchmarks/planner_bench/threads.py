"""The planner's step times for `Pipe` (the thread runner) against measured steps.

`pipe.plan.planned_pipe` plans with runner="threads". Its time model gives
each action its layers' profiled times plus the thread runner's overhead per
action, measured once per machine on partitions too small to take time
(pipe.plan.link.cached_thread_overhead), and lets the two partitions overlap
freely (the interpreter lock is not modelled). This benchmark measures how
far that holds, and what the model predicted without the overhead. For the planner benchmark's MLP and
transformer (`benchmarks/planner.py budget`), two CPU partitions of one thread each
(`cpu_threads=1`), GPipe at 1, 2, 4 and 8 micro-batches, with and without
checkpointing: the plan's predicted step (pipe.plan.predict) beside the
measured one (the fastest of 3 steps, the fastest over the repeats; plans
alternate within each repeat).

Printed and saved to benchmarks/results/planner_threads.json
(planner_threads-quick.json with --quick).

Run:
    python benchmarks/planner.py threads            # about 2 minutes on 2 cores
    python benchmarks/planner.py threads --quick    # the MLP only, 1 repeat
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import planner_bench.budget as models  # noqa: E402  (the planner benchmark's models)
import pipe.plan as planner  # noqa: E402
from pipe import Pipe  # noqa: E402
from pipe.plan import Candidate  # noqa: E402
from pipe.plan.link import cached_thread_overhead  # noqa: E402

CHUNKS = (1, 2, 4, 8)


def validate(name: str, repeats: int) -> dict[str, Any]:
    build, data, loss_fn = models.MODELS[name]
    size = models.SIZES["full"][name]
    x, y = data(size)
    layers = len(build(size))
    costs = planner.profile_costs(build(size), x, CHUNKS, loss_fn=loss_fn, target=y, stages=2)
    plans = [Candidate("gpipe", chunks, (layers // 2, layers - layers // 2), checkpoint)
             for chunks in CHUNKS for checkpoint in ("never", "always")]
    measured: dict[Candidate, list[float]] = {c: [] for c in plans}
    for _ in range(repeats):
        for c in plans:
            model = Pipe(build(size), chunks=c.chunks, balance=list(c.balance), devices=["cpu", "cpu"],
                         checkpoint=c.checkpoint, cpu_threads=1)
            for _ in range(2):  # warm-up
                loss_fn(model(x), y).backward()
            steps = []
            for _ in range(3):
                begun = time.perf_counter()
                loss_fn(model(x), y).backward()
                steps.append(time.perf_counter() - begun)
            measured[c].append(min(steps))
            model.close()
    overhead = cached_thread_overhead()  # what pipe.plan.plan(runner="threads") uses on the CPU
    with_overhead = planner.TimeModel(action_overhead=overhead or 0.0)
    rows = []
    for c in plans:
        predicted = planner.predict(costs, c, runner="threads", model=with_overhead).step_time
        bare = planner.predict(costs, c, runner="threads").step_time
        fastest = min(measured[c])
        rows.append({"plan": c.describe(), "predicted_ms": predicted * 1e3, "measured_ms": fastest * 1e3,
                     "error": predicted / fastest - 1, "bare_ms": bare * 1e3, "bare_error": bare / fastest - 1})
    errors, bare_errors = [r["error"] for r in rows], [r["bare_error"] for r in rows]
    return {"size": size, "action_overhead_ms": (overhead or 0.0) * 1e3, "plans": rows,
            "error_median": statistics.median(errors), "error_worst": max(errors, key=abs),
            "bare_error_median": statistics.median(bare_errors), "bare_error_worst": max(bare_errors, key=abs)}


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the MLP only, 1 repeat")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the profile times layers on one thread, as each partition computes
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    names = ("mlp",) if args.quick else ("mlp", "transformer")
    results = {name: validate(name, 1 if args.quick else 3) for name in names}
    for name, found in results.items():
        print(f"[{name}] predicted / measured step - 1, with the measured overhead of "
              f"{found['action_overhead_ms']:.2f} ms per action: median {found['error_median']:+.0%}, worst "
              f"{found['error_worst']:+.0%} (without it: median {found['bare_error_median']:+.0%}, worst "
              f"{found['bare_error_worst']:+.0%})")
        for row in found["plans"]:
            print(f"  {row['plan']:48s} predicted {row['predicted_ms']:7.1f} ms  measured {row['measured_ms']:7.1f} ms"
                  f"  {row['error']:+.0%}  (without the overhead {row['bare_error']:+.0%})")
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "load_before": load_before, "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg())},
           **results}
    path = HERE / "results" / ("planner_threads-quick.json" if args.quick else "planner_threads.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")

