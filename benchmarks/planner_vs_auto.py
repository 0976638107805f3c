"""The planner's plan against ``auto_schedule``'s order on the zero-bubble benchmark's model, in one simulation,
and what the cost-shaped orders cost the planner.

Issue 51's check of the one planner: without a memory budget, is the plan
``pipe.plan.search`` chooses never slower in simulation than the cut and order
of ``pipe.plan.auto_schedule`` (the same search without a budget, over the
cost-shaped orders alone)? The planner runs three ways:

* ``planner_fixed``: the fixed schedules alone (``schedules=[gpipe, 1f1b, interleaved, zb-h1, zbv]``);
* ``planner_default``: its default, the fixed schedules and the orders built
  from the costs, each built only for a cut whose bound is below the fastest plan found;
* ``planner_every_cut``: the orders built for every cut it visits
  (``schedules=[..., "auto", "auto-v"]``).

Each search is timed in CPU seconds (``time.process_time``, cold: no order or
lowered program cached). The model is ``benchmarks/zero_bubble.py``'s (L Linear+ReLU blocks of width W,
B rows, M micro-batches, 2 and 4 ranks). Its layers are profiled once per M
(``pipe.plan.profile_costs``); ``auto_schedule`` is given the same layer times
(``times=``), so all choose from one measurement. Each choice is then timed
under the planner's stage costs of its own cut (``Costs.stage_costs``, the
runner's overhead per action from ``--action-us``; messages free, as on one
machine's loopback they are small beside these layers) by the one simulator
(``pipe.core.stage_costs.lowered_step``).

Run:
    python benchmarks/planner_vs_auto.py --runs 3        # W=256 L=8 B=512 M=4 and 8, checkpoint never and always
Results: benchmarks/results/planner_vs_auto.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "planner_vs_auto.json"
FIXED = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


def main() -> None:
    from pipe.plan import auto_schedule
    from pipe.balance.timing import LayerTimes
    from pipe.core.options import checkpoint_stop
    from pipe.core.program_time import _lowered, _lowered_rank
    from pipe.core.stage_costs import lowered_step
    from pipe.plan import TimeModel, profile_costs, search

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--action-us", type=float, default=50.0, help="the runner's overhead per action")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=1, help="profile and plan this many times (the spread)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)])
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    overhead = args.action_us * 1e-6
    time_model = TimeModel(action_overhead=overhead)
    rows: list[dict[str, Any]] = []
    for run, chunks in [(r, m) for r in range(args.runs) for m in args.microbatches]:  # profiled at this chunk
        # count alone: every plan below uses it
        costs = profile_costs(model, x, [chunks], loss_fn=nn.functional.mse_loss, target=y)
        r = costs.rows(chunks)
        times = LayerTimes(forward={r: costs.forward[r]}, backward={r: costs.backward[r]},
                           input_grad={r: costs.input_grad[r]}, weight_grad={r: costs.weight_grad[r]},
                           output_bytes={r: costs.output_bytes.get(r, [0] * costs.layers)}, rounds=0)
        for ranks, checkpoint in [(n, c) for n in args.ranks for c in ("never", "always")]:
            stop = checkpoint_stop(checkpoint, chunks)

            def timed(balance: list[int], schedule: Any) -> float:
                bounds = [(sum(balance[:s]), sum(balance[:s + 1])) for s in range(len(balance))]
                return lowered_step(schedule, costs.stage_costs(bounds, chunks, overhead=overhead), stop)

            auto = auto_schedule(model, ranks=ranks, chunks=chunks, checkpoint=checkpoint, times=times,
                                 action_seconds=overhead)
            row: dict[str, Any] = {"run": run, "ranks": ranks, "chunks": chunks, "checkpoint": checkpoint,
                                   "auto_schedule": {"balance": auto.balance, "order": auto.schedule.name,
                                                     "step_s": timed(auto.balance, auto.schedule)}}
            for name, kinds in (("planner_fixed", FIXED), ("planner_default", None),
                                ("planner_every_cut", FIXED + ["auto", "auto-v"])):
                fresh = copy.deepcopy(costs)  # no order built by an earlier search
                _lowered.cache_clear()
                _lowered_rank.cache_clear()
                start = time.process_time()
                plan = search(fresh, ranks, None, runner="processes", model=time_model, schedules=kinds,
                              checkpoints=[checkpoint], per_stage=False)
                row[name] = {"plan": plan.candidate.describe(), "step_s": plan.best.step_time,
                             "search_cpu_s": time.process_time() - start}
            for name in ("planner_fixed", "planner_default", "planner_every_cut"):
                row[f"{name}_over_auto_schedule"] = row[name]["step_s"] / row["auto_schedule"]["step_s"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for name in ("planner_fixed", "planner_default", "planner_every_cut"):
        cpu = sorted(r[name]["search_cpu_s"] for r in rows)
        over = [r[name]["step_s"] / r["planner_every_cut"]["step_s"] for r in rows]
        summary[name] = {"search_cpu_s_median": statistics.median(cpu), "search_cpu_s_range": [cpu[0], cpu[-1]],
                         "step_as_every_cut": sum(o <= 1 + 1e-9 for o in over), "cases": len(rows),
                         "worst_over_every_cut": max(over),
                         "over_auto_schedule_range": [min(r[f"{name}_over_auto_schedule"] for r in rows),
                                                      max(r[f"{name}_over_auto_schedule"] for r in rows)]}
        print(f"{name}: search CPU {summary[name]['search_cpu_s_median']:.2f} s median ({cpu[0]:.2f}-{cpu[-1]:.2f}); "
              f"step as every cut's in {summary[name]['step_as_every_cut']} of {len(rows)} (worst "
              f"{max(over) - 1:+.1%}); over auto_schedule {summary[name]['over_auto_schedule_range'][0]:.2f}-"
              f"{summary[name]['over_auto_schedule_range'][1]:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"config": vars(args), "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
