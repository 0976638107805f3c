"""Planner validation for the split of 4 ranks between pipeline, replicas and FSDP sharding (pp x dp_replicate x
dp_shard).

For the MLP stack of `benchmarks/planner.py budget`, on 4 gloo ranks on the CPU:

1. the costs are profiled once (with the loss), the link (and FSDP's
   overheads, :func:`pipe.plan.link.measure_link`) is measured once per machine;
2. every candidate that ``pipe.plan.search(..., dp_shard="auto",
   dp_replicate="auto")`` compares for the restricted grid (GPipe, 1F1B,
   interleaved; checkpoint "never"; even balances) is *run* on the mesh of its
   split, each pipeline on its part of the batch: pp4, pp2 x dp_shard2 (ZeRO-3
   gathering a stage whole or a layer at a time, reducing once a step or after
   each backward, and ZeRO-2 where a rank holds two stages), pp1 x dp_shard4, pp2 x
   dp_replicate2, pp1 x dp_replicate4 and pp1 x dp_replicate2 x dp_shard2
   (HSDP). Per rank the step's bytes are counted (activations, buffers, FSDP's
   unsharded parameters and gradients, the replicas' averager's flat copies)
   and the step timed, the fastest of 3 steps in each of ``--sweeps`` sweeps;
3. the prediction of every plan is compared with the measurement (step
   time: the slowest rank; peak: every rank against its pipeline rank's);
4. for budgets between the smallest and the largest predicted peak, the
   planner's chosen plan against the measured fastest plan whose measured peak fits.

The time model is the measured link and overheads (``time_model``); then,
to see whether its form holds where its constants do not, overhead per action
and contention are fitted (:func:`pipe.plan.fit`) to the first plan of each
split and every other plan predicted with them (``fitted``). 4 processes share
2 cores, which FSDP's ring collectives feel most (every rank of a ring must
run for each of its steps).

Run:
    python benchmarks/planner.py split            # full: width 512, 8 blocks, 3 sweeps, 68 plans: 5-7 min (2 cores)
    python benchmarks/planner.py split --quick    # width 128, 4 blocks, 1 sweep
    python benchmarks/planner.py split --ranks 2  # the splits of 2 ranks, a core each: about 1 min
Results: benchmarks/results/planner_split.json (planner_split-quick.json with --quick; planner_split-2ranks.json
with --ranks 2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch.nn.functional as F

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from planner_bench.budget import load, mlp_data, mlp_model  # noqa: E402

from pipe.plan import Candidate, TimeModel, fit, predict, profile_costs, search  # noqa: E402
from pipe.distributed.local_ranks import run_local_ranks  # noqa: E402
from pipe.plan.link import cached_link  # noqa: E402
from pipe.plan.measure import measure_step  # noqa: E402
from pipe.plan.sharding import split_candidates, split_text  # noqa: E402

RANKS = 4  # the default; --ranks 2 gives each process a core of the 2-core machine
SIZES = {"full": dict(width=512, layers=8, batch=64), "quick": dict(width=128, layers=4, batch=32)}
MODES = {"full": dict(chunks=(1, 2, 4, 8), sweeps=3, budgets=8), "quick": dict(chunks=(1, 2, 4), sweeps=1, budgets=4)}
OPTIONS = dict(schedules=("gpipe", "1f1b", "interleaved"), checkpoints=("never",))


def _rank(rank: int, world: int, size: dict[str, int], grid: list[Candidate], sweeps: int) -> list[list[Any]]:
    from pipe.core.microbatch import scatter
    from pipe.distributed import DistributedPipe, make_mesh

    x, y = mlp_data(size)
    measured: list[list[Any]] = []
    for sweep in range(sweeps):
        if rank == 0:
            print(f"sweep {sweep + 1} of {sweeps} (load {load()})", flush=True)
        for k, c in enumerate(grid):
            model = DistributedPipe(mlp_model(size), mesh=make_mesh(**c.mesh_kwargs()), **c.distributed_kwargs())
            parts, part = model.topology.data_parallel, model.topology.replica
            xs, ys = (scatter(x, parts)[part].value, scatter(y, parts)[part].value) if parts > 1 else (x, y)
            m = measure_step(model, xs, ys, F.mse_loss, repeat=3)
            if sweep == 0:
                measured.append([model.topology.pipeline_rank, m.activation_peak, m.step_time])
            else:
                measured[k][2] = min(measured[k][2], m.step_time)
    return measured


def run(size: dict[str, int], grid: list[Candidate], sweeps: int, world: int) -> list[list[list[Any]]]:
    return run_local_ranks(_rank, world, size, grid, sweeps, timeout=600.0, deadline=3000.0, start_method="fork")


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, one sweep")
    parser.add_argument("--ranks", type=int, default=RANKS, choices=[2, 4],
                        help="ranks to split (default 4; 2: a core per process on the 2-core machine)")
    args = parser.parse_args(argv)
    world = args.ranks
    kind = "quick" if args.quick else "full"
    size, mode = SIZES[kind], MODES[kind]
    begun = time.perf_counter()
    load_before = load()
    x, y = mlp_data(size)
    costs = profile_costs(mlp_model(size), x, mode["chunks"], loss_fn=F.mse_loss, target=y, threads=1,  # as the ranks
                          stages=world)
    model = TimeModel.measured(cached_link(), cores=os.cpu_count())  # the ranks share this machine's cores
    grid, skipped = split_candidates(costs, world, "processes", "auto", (3, 2), "auto", balances=None, **OPTIONS)
    grid = [c for c in grid if len(set(c.balance)) == 1]  # even balances
    measured = run(size, grid, mode["sweeps"], world)
    plans = []
    for k, c in enumerate(grid):
        p = predict(costs, c, runner="processes", model=model)
        step = max(measured[r][k][2] for r in range(world))
        peaks = [(p.peaks[measured[r][k][0]] - p.static[measured[r][k][0]], measured[r][k][1]) for r in range(world)]
        plans.append({"plan": c.describe(), "split": split_text(c).split(" zero")[0], "candidate": c,
                      "predicted_ms": p.step_time * 1e3, "measured_ms": step * 1e3,
                      "step_error": p.step_time / step - 1, "predicted_peak": p.peak,
                      "measured_peak": max(m + p.static[measured[r][k][0]] for r, (_, m) in enumerate(peaks)),
                      "peak_error": max(abs(a / b - 1) for a, b in peaks)})
    low, high = min(p["predicted_peak"] for p in plans), max(p["predicted_peak"] for p in plans)
    budgets = [int(low + (high - low) * i / (mode["budgets"] - 1)) for i in range(mode["budgets"])]
    choices = []
    for budget in budgets:
        chosen = search(costs, world, budget, runner="processes", dp_shard="auto", dp_replicate="auto", model=model,
                        per_stage=False,
                        balances=[c.balance for c in grid], **OPTIONS)
        row = next(p for p in plans if p["candidate"] == chosen.candidate)
        fitting = [p for p in plans if p["measured_peak"] <= budget]
        fastest = min(fitting, key=lambda p: p["measured_ms"]) if fitting else None
        choices.append({"budget": budget, "chosen": row["plan"], "chosen_ms": row["measured_ms"],
                        "fits": row["measured_peak"] <= budget,
                        "fastest_fitting": fastest["plan"] if fastest else None,
                        "same_split": fastest is not None and fastest["split"] == row["split"],
                        "chosen_vs_fastest": row["measured_ms"] / fastest["measured_ms"] if fastest else None,
                        "splits": chosen.splits})
    errors = [abs(p["step_error"]) for p in plans]
    first_of_split: dict[tuple[int, int, int], Candidate] = {}
    for p in plans:
        c = p["candidate"]
        first_of_split.setdefault((c.ranks, c.dp_replicate, c.dp_shard), c)
    calibration = list(first_of_split.values())
    times = {p["candidate"]: p["measured_ms"] / 1e3 for p in plans}
    fitted = fit(costs, {c: times[c] for c in calibration}, link=model.link, cores=model.cores)
    fitted_errors = {p["plan"]: predict(costs, p["candidate"], runner="processes", timeline=False,
                                        model=fitted).step_time / times[p["candidate"]] - 1
                     for p in plans if p["candidate"] not in calibration}
    result = {"mode": kind, "size": size, "settings": {**mode, "chunks": list(mode["chunks"])},
              "ranks": world, "time_model": model.describe(), "left_out": skipped,
              "plans": [{k: v for k, v in p.items() if k != "candidate"} for p in plans], "budgets": choices,
              "step_error_worst": max(errors), "step_error_median": statistics.median(errors),
              "fitted": {"model": fitted.describe(), "fitted_on": [c.describe() for c in calibration],
                         "errors": fitted_errors,
                         "step_error_worst": max(abs(e) for e in fitted_errors.values()),
                         "step_error_median": statistics.median(abs(e) for e in fitted_errors.values())},
              "peak_error_worst": max(p["peak_error"] for p in plans),
              "chosen_within_5pct": sum(1 for c in choices if c["chosen_vs_fastest"] is not None
                                        and c["chosen_vs_fastest"] <= 1.05) / len(choices),
              "fit_share": sum(1 for c in choices if c["fits"]) / len(choices),
              "chosen_split_is_fastest_split": sum(1 for c in choices if c["same_split"]) / len(choices),
              "load_before": load_before, "load_after": load(), "seconds": time.perf_counter() - begun}
    for p in plans:
        print(f"  {p['plan']:<78} predicted {p['predicted_ms']:8.2f} ms  measured {p['measured_ms']:8.2f} ms  "
              f"error {p['step_error']:+6.1%}  peak error {p['peak_error']:.2%}")
    for c in choices:
        ratio = f"{c['chosen_vs_fastest']:.2f}x the fastest fitting" if c["chosen_vs_fastest"] else "nothing fits"
        print(f"budget {c['budget']:>10} B: chosen {c['chosen']} ({'fits' if c['fits'] else 'OVER'}; {ratio}; "
              f"fastest fitting: {c['fastest_fitting']})")
    print(f"fitted on the first plan of each split ({fitted.describe()}): step error on the other "
          f"{len(fitted_errors)} plans worst {result['fitted']['step_error_worst']:.1%}, median "
          f"{result['fitted']['step_error_median']:.1%}")
    print(f"step error worst {result['step_error_worst']:.1%} (median {result['step_error_median']:.1%}); peak error "
          f"worst {result['peak_error_worst']:.2%}; chosen within 5%: {result['chosen_within_5pct']:.0%}; "
          f"fit: {result['fit_share']:.0%}; chosen split = measured fastest fitting plan's split: "
          f"{result['chosen_split_is_fastest_split']:.0%}")
    RESULTS.mkdir(exist_ok=True)
    name = "planner_split" + ("-2ranks" if world == 2 else "")
    path = RESULTS / (f"{name}-quick.json" if args.quick else f"{name}.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} in {result['seconds']:.0f} s (load before {load_before}, after {result['load_after']})")

