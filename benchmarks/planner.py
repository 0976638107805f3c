"""Planner validation: predicted vs measured peak memory and step time, chosen vs best plan, explained idle time.

For two models (the P2 MLP stack of benchmarks/core.py and the transformer of
examples/transformer_lm.py), on 2 ranks of DistributedPipe over gloo on the CPU:

1. the costs are profiled once (pipe.plan.profile_costs, with the loss);
2. every candidate of a grid (schedules gpipe / 1f1b / interleaved, chunks
   1, 2, 4, 8, every checkpoint mode, a few balances) is *run*: per rank, the
   activation bytes of one step are counted (pipe.recompute.ActivationMemory,
   allocator-independent) and the step is timed (fastest of a few);
3. the runner's overhead per action is calibrated on one reference plan
   (pipe.plan.calibrate), then every plan's step time is predicted;
4. for 20 budgets spread between the smallest and the largest predicted peak,
   pipe.plan.search chooses a plan from the same candidates; the JSON says
   whether its measured peak stays under the budget, how far the predicted
   peak is from the measured one, and how far its measured step time is from
   the fastest grid plan whose measured peak fits;
5. one step of a chosen plan is recorded (pipe.trace, one file per rank,
   merged) and explained (pipe.plan.explain): the share of each rank's wall
   time attributed to compute, transfer or a named idle cause.

Memory: static bytes (parameters, gradients, SGD: param_scale=2) are the same
formula on both sides; "measured peak" = static + counted activation peak.

Run:
    python benchmarks/planner.py            # a few minutes on 2 shared cores
    python benchmarks/planner.py --quick    # smaller models, about a minute
Results: benchmarks/results/planner.json (planner-quick.json with --quick).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import pipe.plan as planner  # noqa: E402
from pipe import trace  # noqa: E402
from pipe.plan import Candidate  # noqa: E402
from pipe.plan.measure import measure_step  # noqa: E402
from pipe.plan.search import candidates  # noqa: E402

SIZES = {
    "full": {"mlp": dict(width=512, layers=8, batch=64),
             "transformer": dict(width=128, layers=4, heads=4, seq=64, vocab=96, batch=16)},
    "quick": {"mlp": dict(width=128, layers=4, batch=32),
              "transformer": dict(width=64, layers=2, heads=2, seq=32, vocab=64, batch=8)},
}


def mlp_model(size: dict[str, int]) -> nn.Sequential:
    from core import mlp

    return mlp(size["width"], size["layers"])


def mlp_data(size: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size["batch"], size["width"], generator=g), torch.randn(size["batch"], size["width"], generator=g)


def transformer_model(size: dict[str, int]) -> nn.Sequential:
    from transformer_lm import build_model

    torch.manual_seed(0)
    return build_model(size["vocab"], size["width"], size["layers"], size["heads"], size["seq"], dropout=0.0)


def transformer_data(size: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


MODELS: dict[str, tuple[Callable[..., nn.Sequential], Callable[..., Any], Callable[..., torch.Tensor]]] = {
    "mlp": (mlp_model, mlp_data, F.mse_loss),
    "transformer": (transformer_model, transformer_data, lm_loss),
}


def _rank(rank: int, port: int, name: str, size: dict[str, int], grid: list[Candidate], record: Candidate,
          results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    from pipe.distributed import DistributedPipe

    build, data, loss_fn = MODELS[name]
    x, y = data(size)
    measured: list[tuple[int, float]] = []
    for sweep in range(2):  # two sweeps over the grid, minutes apart: the faster time of each plan counts
        for k, c in enumerate(grid):
            model = DistributedPipe(build(size), chunks=c.chunks, balance=list(c.balance), checkpoint=c.checkpoint,
                                    schedule=c.schedule, virtual_stages=c.virtual_stages)
            m = measure_step(model, x, y, loss_fn, repeat=3)
            if sweep == 0:
                measured.append((m.activation_peak, m.step_time))
            else:
                measured[k] = (measured[k][0], min(measured[k][1], m.step_time))
    model = DistributedPipe(build(size), chunks=record.chunks, balance=list(record.balance),
                            checkpoint=record.checkpoint, schedule=record.schedule,
                            virtual_stages=record.virtual_stages)
    model.step(x, y, loss_fn)
    dist.barrier()
    with trace.record(rank=rank, schedule=record.schedule, checkpoint=record.checkpoint) as recorder:
        model.step(x, y, loss_fn)
    dist.barrier()
    results.put({"rank": rank, "measured": measured, "trace": recorder.trace()})
    dist.destroy_process_group()


def run_ranks(name: str, size: dict[str, int], grid: list[Candidate], record: Candidate) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    results: "multiprocessing.Queue[Any]" = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, name, size, grid, record, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    ranks = sorted((results.get(timeout=3000) for _ in processes), key=lambda r: r["rank"])
    for process in processes:
        process.join()
    return ranks


def balances_for(layers: int) -> list[list[int]]:
    half = layers // 2
    two = [[half, layers - half], [half - 1, layers - half + 1], [half + 1, layers - half - 1]]
    q, r = divmod(layers, 4)
    four = [[q + (1 if k < r else 0) for k in range(4)]]
    return [b for b in two + four if min(b) >= 1]


def validate(name: str, size: dict[str, int], budgets_count: int) -> dict[str, Any]:
    build, data, loss_fn = MODELS[name]
    model = build(size)
    x, y = data(size)
    torch.set_num_threads(1)  # as each rank runs (one intra-op thread per rank)
    begun = time.perf_counter()
    costs = planner.profile_costs(model, x, (1, 2, 4, 8), loss_fn=loss_fn, target=y)
    balances = balances_for(len(model))
    grid = candidates(costs, 2, "processes", balances=balances)
    predicted = {c: planner.predict(costs, c, runner="processes", timeline=False) for c in grid}
    planning_s = time.perf_counter() - begun
    lo, hi = min(p.peak for p in predicted.values()), max(p.peak for p in predicted.values())
    budgets = [int(lo + (hi - lo) * k / (budgets_count - 1)) for k in range(budgets_count)]
    # The plan whose step is recorded and explained: chosen before calibration (nothing is measured yet).
    recorded = planner.search(costs, 2, budgets[budgets_count // 2], runner="processes", balances=balances)

    print(f"[{name}] {len(grid)} candidates; running each on 2 ranks ...", flush=True)
    ranks = run_ranks(name, size, grid, recorded.candidate)
    measured_peak = {c: [predicted[c].static[r] + ranks[r]["measured"][k][0] for r in range(2)]
                     for k, c in enumerate(grid)}
    measured_time = {c: max(ranks[r]["measured"][k][1] for r in range(2)) for k, c in enumerate(grid)}

    # Time: calibrate the runner's overhead per action on one plan, predict the others.
    reference = Candidate("gpipe", 2, tuple(balances[0]), "never")
    uncalibrated = {c: predicted[c].step_time for c in grid}
    try:
        overhead = planner.calibrate(costs, reference, measured_time[reference], runner="processes")
        calibration = "ok"
    except ValueError as error:  # layer times inflated by other processes while profiling
        print(f"[{name}] calibration failed: {error}", flush=True)
        overhead, calibration = 0.0, f"failed: {error}"
    timed = {c: planner.predict(costs, c, runner="processes", timeline=False).step_time for c in grid}
    schedule_times = []
    for kind, virtual, balance in (("gpipe", 1, balances[0]), ("1f1b", 1, balances[0]),
                                   ("interleaved", 2, balances[-1])):
        for chunks in (2, 4, 8):
            c = Candidate(kind, chunks, tuple(balance), "never", virtual)
            schedule_times.append({
                "plan": c.describe(), "predicted_ms": timed[c] * 1e3, "measured_ms": measured_time[c] * 1e3,
                "error": timed[c] / measured_time[c] - 1,
                "uncalibrated_error": uncalibrated[c] / measured_time[c] - 1})

    memory_errors = [predicted[c].peaks[r] / measured_peak[c][r] - 1 for c in grid for r in range(2)]
    worst = sorted(((predicted[c].peaks[r] / measured_peak[c][r] - 1, c.describe(), r, predicted[c].peaks[r],
                     measured_peak[c][r]) for c in grid for r in range(2)), key=lambda w: -abs(w[0]))[:5]
    rows = []
    for budget in budgets:
        chosen = planner.search(costs, 2, budget, runner="processes", balances=balances).candidate
        fitting = [c for c in grid if max(measured_peak[c]) <= budget]
        best = min(fitting, key=lambda c: measured_time[c]) if fitting else None
        rows.append({
            "budget": budget, "plan": chosen.describe(),
            "predicted_peak": predicted[chosen].peaks, "measured_peak": measured_peak[chosen],
            "under_budget": max(measured_peak[chosen]) <= budget,
            "peak_error": max(abs(p / m - 1) for p, m in zip(predicted[chosen].peaks, measured_peak[chosen])),
            "measured_ms": measured_time[chosen] * 1e3,
            "best_grid_plan": best.describe() if best else None,
            "best_grid_ms": measured_time[best] * 1e3 if best else None,
            "slower_than_best": measured_time[chosen] / measured_time[best] - 1 if best else None,
        })

    middle = planner.search(costs, 2, budgets[budgets_count // 2], runner="processes", balances=balances)
    merged = trace.merge([r["trace"] for r in ranks])
    explanation = planner.explain(merged)
    # DistributedPipe's defaults: 1f1b, chunks=1, checkpoint="except_last" (which, at one micro-batch, is "never").
    default = Candidate("1f1b", 1, tuple(balances[0]), "never")
    hand = [Candidate("gpipe", 8, tuple(balances[0]), "never"), Candidate("1f1b", 4, tuple(balances[0]), "always")]
    compare = []
    for label, c in [("planned", middle.candidate), ("default", default),
                     *[("hand", h) for h in hand]]:
        compare.append({"config": label, "plan": c.describe(), "measured_ms": measured_time[c] * 1e3,
                        "predicted_ms": timed[c] * 1e3, "measured_peak_mib": max(measured_peak[c]) / 2**20,
                        "predicted_peak_mib": predicted[c].peak / 2**20,
                        "fits_middle_budget": max(measured_peak[c]) <= budgets[budgets_count // 2]})
    slower = [r["slower_than_best"] for r in rows if r["slower_than_best"] is not None]
    return {
        "size": size, "layers": len(model), "candidates": len(grid), "planning_s": planning_s,
        "calibrated_overhead_ms_per_action": overhead * 1e3, "calibration_plan": reference.describe(),
        "calibration": calibration,
        "budgets": rows,
        "chosen_under_budget_share": sum(r["under_budget"] for r in rows) / len(rows),
        "peak_error_max_all_plans": max(abs(e) for e in memory_errors),
        "peak_error_median_all_plans": statistics.median(abs(e) for e in memory_errors),
        "peak_error_worst": [{"error": e, "plan": d, "rank": r, "predicted": p, "measured": m}
                             for e, d, r, p, m in worst],
        "chosen_slower_than_best_max": max(slower) if slower else None,
        "chosen_within_5pct_of_best_share": sum(s <= 0.05 for s in slower) / len(slower) if slower else None,
        "schedule_times": schedule_times,
        "time_error_max": max(abs(t["error"]) for t in schedule_times),
        "explained": {"plan": recorded.candidate.describe(), "rows": explanation.summary(),
                      "attributed_min": min(explanation.attributed(r) for r in range(len(explanation.rows))),
                      "table": explanation.table()},
        "compare_at_middle_budget": {"budget_mib": budgets[budgets_count // 2] / 2**20, "rows": compare},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models (about a minute)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--budgets", type=int, default=20)
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "full"]
    result: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "note": "2 gloo ranks on a shared CPU machine; wall-clock times are noisy"},
        "targets": {"chosen_under_budget_share": "1.0", "peak_error": "<= 0.05",
                    "chosen_slower_than_best": "<= 0.05", "time_error": "<= 0.05", "attributed": ">= 0.99"},
    }
    for name in args.models:
        r = validate(name, sizes[name], args.budgets)
        result[name] = r
        print(f"\n== {name}: {r['layers']} layers, {r['candidates']} candidates, planned in {r['planning_s']:.1f} s")
        print(f"chosen plans under budget when run: {r['chosen_under_budget_share']:.0%}")
        print(f"predicted vs measured peak, all plans and ranks: max {r['peak_error_max_all_plans']:.2%}, "
              f"median {r['peak_error_median_all_plans']:.2%}")
        if r["chosen_slower_than_best_max"] is not None:
            print(f"chosen vs fastest fitting grid plan (measured): worst {r['chosen_slower_than_best_max']:+.1%}, "
                  f"within 5% for {r['chosen_within_5pct_of_best_share']:.0%} of budgets")
        print(f"step time (overhead {r['calibrated_overhead_ms_per_action']:.3f} ms/action calibrated on "
              f"{r['calibration_plan']}):")
        for t in r["schedule_times"]:
            print(f"  {t['plan']:<58} predicted {t['predicted_ms']:8.2f} ms  measured {t['measured_ms']:8.2f} ms  "
                  f"error {t['error']:+.1%} (uncalibrated {t['uncalibrated_error']:+.1%})")
        print(f"explained share of wall time, worst rank: {r['explained']['attributed_min']:.2%}")
        print(r["explained"]["table"])
        print(f"at the middle budget ({r['compare_at_middle_budget']['budget_mib']:.2f} MiB):")
        for row in r["compare_at_middle_budget"]["rows"]:
            print(f"  {row['config']:<24} {row['plan']:<58} {row['measured_ms']:8.2f} ms "
                  f"{row['measured_peak_mib']:8.2f} MiB fits={row['fits_middle_budget']}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("planner-quick.json" if args.quick else "planner.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
