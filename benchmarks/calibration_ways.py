"""Ways to calibrate the planner's time model, judged on plans none was calibrated on.

Issue 51 asks for one calibration, "from a traced step". ``pipe.plan.calibrate``
runs five calibration plans, records their steps, reads each phase's compute
(F, I, W, B) off the recorded steps (``pipe.plan.timing.recorded_phases``) and
fits the constants that remain (overhead per action and per message,
contention) to the plans' wall-clock steps (``pipe.plan.fit`` with
``traced=``). This benchmark judges that against its two halves: the constants
fitted to the wall-clock steps alone (``fit`` without ``traced=``, the
calibration before), and everything read off the recorded steps (``fit`` with
too few step times: the phases and the runner's time per action, as
``calibrated_schedule`` reads a job's one recorded plan). It runs the five
calibration plans and ``--held-out`` other plans of the grid (drawn with a
fixed seed) on 2 local gloo ranks, records every timed step, builds each model
from the calibration plans alone, and predicts every plan with each: the error
on the held-out plans is what a calibration is for.

Each rank computes with one thread (as under ``torchrun``), and the layers
are profiled with one thread too.

Run:
    python benchmarks/calibration_ways.py [--runs 3] [--width 256 --layers 8 --batch 64]
Results: benchmarks/results/calibration_ways.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "calibration_ways.json"


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                           for _ in range(layers)])


def _rank(rank: int, world: int, plans: list[Any], width: int, layers: int, x: torch.Tensor, y: torch.Tensor,
          sweeps: int, repeat: int) -> list[list[tuple[list[float], dict[str, Any]]]]:
    """Per plan and sweep: the timed steps' seconds on this rank, and their trace."""
    import pipe.trace
    from pipe.distributed import DistributedPipe

    found: list[list[tuple[list[float], dict[str, Any]]]] = [[] for _ in plans]
    for _ in range(sweeps):  # the plans in turn, each sweep: a burst of load slows one sweep, not one plan
        for k, plan in enumerate(plans):
            torch.manual_seed(0)
            model = DistributedPipe(build(width, layers), **plan.distributed_kwargs())
            for _ in range(2):  # warm-up: allocates the gradients, and the CPU's second step still runs slow
                model.step(x, y, F.mse_loss)
            seconds = []
            with pipe.trace.record(None, rank=rank) as recorder:
                for _ in range(repeat):
                    begun = time.perf_counter()
                    model.step(x, y, F.mse_loss)
                    seconds.append(time.perf_counter() - begun)
            torch.distributed.barrier()
            found[k].append((seconds, recorder.trace()))
    return found


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    from pipe.balance.traced import traced_step
    from pipe.distributed.local_ranks import run_local_ranks
    from pipe.plan import TimeModel, fit, predict, profile_costs
    from pipe.plan.calibration import calibration_plans
    from pipe.plan.candidates import candidates

    torch.set_num_threads(1)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    costs = profile_costs(build(args.width, args.layers), x, (1, 2, 4, 8))
    grid = [c for c in candidates(costs, 2, "processes")
            if c.parts == 1 and not any(c.recompute) and not c.selective()]
    calibration = calibration_plans(grid, costs)
    held_out = random.Random(args.seed).sample([c for c in grid if c not in calibration], args.held_out)
    plans = calibration + held_out
    ranks = run_local_ranks(_rank, 2, plans, args.width, args.layers, x, y, args.sweeps, args.repeat,
                            timeout=120.0, deadline=3600.0)
    wall, traced = {}, {}
    for k, plan in enumerate(plans):
        sweeps = [[max(steps) for steps in zip(*(ranks[r][k][s][0] for r in range(2)))] for s in range(args.sweeps)]
        fastest = min(range(args.sweeps), key=lambda s: min(sweeps[s]))
        wall[plan] = min(sweeps[fastest])
        traced[plan] = traced_step([ranks[r][k][fastest][1] for r in range(2)], balance=plan.balance)
    recorded = {c: traced[c] for c in calibration}
    models = {"read off recorded steps, then fitted to wall times (pipe.plan.calibrate)": fit(
                  costs, {c: wall[c] for c in calibration}, traced=recorded, runner="processes"),
              "fitted to wall times alone": fit(costs, {c: wall[c] for c in calibration}, runner="processes"),
              "read off recorded steps alone": fit(costs, {}, traced=recorded, runner="processes"),
              "layer times alone": TimeModel()}
    judged: dict[str, Any] = {}
    for name, model in models.items():
        errors = {c: predict(costs, c, runner="processes", timeline=False, model=model).step_time / wall[c] - 1
                  for c in plans}
        out = [abs(errors[c]) for c in held_out]
        judged[name] = {
            "model": model.describe(),
            "calibration_rms": math.sqrt(statistics.fmean(errors[c] ** 2 for c in calibration)),
            "held_out_rms": math.sqrt(statistics.fmean(e * e for e in out)),
            "held_out_median": statistics.median(out), "held_out_worst": max(out),
            "errors": {c.describe(): errors[c] for c in plans}}
    return {"plans": {c.describe(): {"step_ms": wall[c] * 1e3, "calibration": c in calibration} for c in plans},
            "models": judged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--held-out", type=int, default=12, help="plans of the grid judged, besides the five")
    parser.add_argument("--sweeps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per plan and sweep")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="draws the held-out plans")
    args = parser.parse_args()
    runs = []
    for run in range(args.runs):
        runs.append(one_run(args))
        for name, judged in runs[-1]["models"].items():
            print(f"run {run + 1}: {name}: held-out rms {judged['held_out_rms']:.1%}, median "
                  f"{judged['held_out_median']:.1%}, worst {judged['held_out_worst']:.1%}; on the five "
                  f"calibration plans rms {judged['calibration_rms']:.1%} ({judged['model']})")
    summary = {name: {key: [r["models"][name][key] for r in runs]
                      for key in ("held_out_rms", "held_out_median", "held_out_worst", "calibration_rms")}
               for name in runs[0]["models"]}
    RESULTS.write_text(json.dumps({
        "settings": vars(args), "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                            "python": platform.python_version()},
        "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
