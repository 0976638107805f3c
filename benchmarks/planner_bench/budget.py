"""Planner validation: predicted vs measured step time and peak memory, chosen vs fastest fitting plan.

For three models (the P2 MLP stack of benchmarks/core.py, the transformer of
examples/transformer_lm.py, and a longer-sequence one whose micro-batches are
fixed at one sequence each), on 2 ranks of DistributedPipe over gloo on the CPU:

1. the costs are profiled once (pipe.plan.profile_costs, with the loss), and
   the transport between two local gloo processes is measured once per
   machine (pipe.plan.link.cached_link: seconds per message and per byte);
2. every candidate of a grid is *run*: schedules gpipe / 1f1b / interleaved /
   zb-h1 / zbv, chunks 1, 2, 4, 8, every checkpoint mode, a few balances, and
   the per-stage recompute plans the planner derives for the budgets below.
   Per rank the activation bytes of one step are counted
   (pipe.recompute.ActivationMemory) and the step is timed: the fastest of 3
   steps in each of several sweeps over the grid (a noisy machine slows
   single runs by up to 50%). This machine runs in two states, about 30%
   apart, for seconds to minutes each: each rank times a fixed reference
   computation before and after each plan (`reference`), and a sweep counts
   as quiet when it ran within 10% of the run's fastest reference. A plan's
   step is the fastest of its quiet sweeps (of all, if fewer than two were
   quiet), and up to 4 extra sweeps measure again the plans with fewer than
   two quiet sweeps or whose two fastest differ by more than 5%
   (`extra_sweeps`: how many plans each measured; `quiet_share`: the share
   of all sweeps that were quiet; `reference_ms`). The profile is taken in
   the fast state too (`profile`: its reference before and after over the
   fastest, and the attempts it took). How closely that measures a plan is reported
   too: per plan, the next fastest sweep's step over the fastest
   (`sweep_second_gap_median`, `_p90`, `_max`; per plan `second_sweep_gap`),
   and how many predictions lie within their own plan's gap
   (`step_error_within_gap_share`; `step_error_beyond_gap_worst`, the
   largest error beyond it);
3. the time model's overhead per action and contention are fitted to the
   measured steps of a few calibration plans (pipe.plan.calibration.calibration_plans, the plans
   `pipe-plan --calibrate` runs; five, chunks 1 to 8; pipe.plan.fit), then every plan
   is predicted; the error is reported for every plan, and the worst is taken
   over the plans the model was NOT fitted on (`step_error_worst`);
4. for 20 budgets spread between the smallest predicted peak and the peak of
   the plan predicted fastest without a limit (above it every budget is one decision),
   pipe.plan.search chooses a plan from the same candidates; `fit_share` is
   the share whose measured peak stays under the budget, `chosen_within_5pct`
   the share whose measured time is within 5% of the fastest grid plan whose
   measured peak fits (where the two differ, they are timed again head to head,
   alternating, and that verdict counts; `chosen_within_5pct_grid` is the
   grid's alone);
5. `per_stage_vs_uniform`: at the tightest budget where a per-stage recompute
   plan fits when run, the fastest fitting plan of all against the fastest
   fitting plan with one checkpoint mode for all stages (measured, throughput
   ratio; `per_stage_vs_uniform_max` the largest over the budgets), and the
   same by the fitted model's own predictions over every two-way balance
   (`per_stage_vs_uniform_model`, `_model_max`): the gain the time model
   expects, to read the measured one against;
6. one step of a chosen plan is recorded (pipe.trace) and explained;
7. planning time as the model grows (tabled costs, 25 to 100 layers, 4 and 8 stages).

Run:
    python benchmarks/planner.py budget            # full: 25-40 minutes on 2 cores (more extra sweeps where the machine is slow)
    python benchmarks/planner.py budget --quick    # smaller models, fewer chunks and budgets: a few minutes
Results: benchmarks/results/planner.json (planner-quick.json with --quick).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import pipe.plan as planner  # noqa: E402
from pipe import trace  # noqa: E402
from pipe.plan import Candidate, Costs  # noqa: E402
from pipe.plan.calibration import calibration_plans  # noqa: E402
from pipe.plan.link import cached_link  # noqa: E402
from pipe.plan.measure import measure_step  # noqa: E402
from pipe.plan.search import candidates, per_stage_recompute  # noqa: E402
from pipe.distributed.local_ranks import run_local_ranks  # noqa: E402

SIZES = {
    "full": {"mlp": dict(width=512, layers=8, batch=64),
             "transformer": dict(width=128, layers=4, heads=4, seq=64, vocab=96, batch=16),
             "transformer-long": dict(width=128, layers=8, heads=4, seq=256, vocab=96, batch=8)},
    "quick": {"mlp": dict(width=256, layers=4, batch=32),
              "transformer": dict(width=64, layers=2, heads=2, seq=32, vocab=64, batch=8),
              "transformer-long": dict(width=64, layers=4, heads=2, seq=128, vocab=64, batch=4)},
}
#: Models whose micro-batch is fixed: one sequence each, as language models are trained when activations
#: fill the memory. More micro-batches cannot shrink them, so a tight budget is met by recomputation alone.
FIXED_CHUNKS = frozenset({"transformer-long"})
MODES = {"full": dict(chunks=(1, 2, 4, 8), sweeps=3, budgets=20),
         "quick": dict(chunks=(1, 2, 4), sweeps=2, budgets=8)}


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
    "transformer-long": (transformer_model, transformer_data, lm_loss),
}


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank below) of ``values``."""
    return sorted(values)[int(0.9 * (len(values) - 1))]


def build_pipe(build: Callable[..., nn.Sequential], size: dict[str, int], c: Candidate) -> nn.Module:
    from pipe.distributed import DistributedPipe

    return DistributedPipe(build(size), chunks=c.chunks, balance=list(c.balance), checkpoint=c.checkpoint,
                           schedule=c.schedule, virtual_stages=c.virtual_stages, recompute=c.recompute_config())


AGREE = 0.05
"""A plan is measured again while its two fastest quiet sweeps differ by more than this (relative)."""
EXTRA_SWEEPS = 4
"""At most this many sweeps beyond the first ones, each over the plans not yet measured to :data:`AGREE`
(fewer where one settles less than a tenth of the plans it measured)."""
QUIET = 0.10
"""A measurement is quiet when the reference computation around it ran within this of its fastest in the run."""
_REFERENCE = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)),
              nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]))


def reference() -> float:
    """Seconds of a fixed computation (5 passes of 8 ``Linear(256)`` layers over 64 rows, about 4 ms; the
    fastest of 3): how fast the machine runs right now. This machine switches between a fast and a slow
    state (about 30% apart, for seconds to minutes), which no time model predicts: steps measured in the
    slow state are retaken (:data:`QUIET`)."""
    rows, layers = _REFERENCE
    best = math.inf
    with torch.no_grad():
        for _ in range(3):
            begun = time.perf_counter()
            for _ in range(5):
                layers(rows)
            best = min(best, time.perf_counter() - begun)
    return best


def quiet_profile(profile: Callable[[], Costs], attempts: int = 3) -> tuple[Costs, dict[str, Any]]:
    """``profile()`` taken while the machine runs in its fast state: the fastest :func:`reference` over 8 s
    of probes is the fast state's; each attempt waits up to 30 s for it, and is kept if the references
    before and after it stay within :data:`QUIET` of it (else the attempt with the smallest is kept)."""
    probes, until = [], time.perf_counter() + 8
    while time.perf_counter() < until:
        probes.append(reference())
        time.sleep(0.1)
    fastest = min(probes)

    def attempt() -> tuple[float, Costs]:  # (slowest reference around it over the fastest, the profile)
        deadline = time.perf_counter() + 30
        while not is_quiet(reference(), fastest) and time.perf_counter() < deadline:
            time.sleep(0.2)
        before = reference()
        costs = profile()
        return max(before, reference()) / fastest, costs

    best, taken = attempt(), 1
    while not is_quiet(best[0], 1.0) and taken < attempts:
        best, taken = min(best, attempt(), key=lambda a: a[0]), taken + 1
    return best[1], {"reference_factor": best[0], "attempts": taken}


def is_quiet(ref: float, fastest: float) -> bool:
    """Whether a :func:`reference` of ``ref`` seconds ran in the fast state (within :data:`QUIET` of ``fastest``)."""
    return ref <= fastest * (1 + QUIET)


def quiet_steps(steps: list[float], refs: list[float], fastest: float) -> list[float]:
    """The sorted steps of a plan measured while the machine was in its fast state (all of them if fewer than two were)."""
    calm = sorted(s for s, r in zip(steps, refs) if is_quiet(r, fastest))
    return calm if len(calm) >= 2 else sorted(steps)


def settled(steps: list[float], refs: list[float], fastest: float) -> bool:
    """Whether a plan has two quiet sweeps whose steps agree within :data:`AGREE`."""
    calm = sorted(s for s, r in zip(steps, refs) if is_quiet(r, fastest))
    return len(calm) >= 2 and calm[1] <= calm[0] * (1 + AGREE)


def _rank(rank: int, world: int, name: str, size: dict[str, int], grid: list[Candidate], record: Candidate,
          sweeps: int) -> dict[str, Any]:
    build, data, loss_fn = MODELS[name]
    x, y = data(size)
    peaks: dict[int, int] = {}  # per plan: its counted peak (first sweep)
    steps: list[list[float]] = [[] for _ in grid]  # per plan: the step (its slower rank's) in each sweep
    refs: list[list[float]] = [[] for _ in grid]  # per plan: the slowest reference around it in each sweep

    def sweep(plans: list[int]) -> None:
        times = torch.zeros(2, len(plans), dtype=torch.float64)
        for i, k in enumerate(plans):
            before = reference()
            m = measure_step(build_pipe(build, size, grid[k]), x, y, loss_fn, repeat=3)
            peaks.setdefault(k, m.activation_peak)
            times[0, i], times[1, i] = m.step_time, max(before, reference())
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # both ranks decide alike what to measure again
        for i, k in enumerate(plans):
            steps[k].append(float(times[0, i]))
            refs[k].append(float(times[1, i]))

    def unsettled() -> list[int]:
        fastest = min(map(min, refs))
        return [k for k in range(len(grid)) if not settled(steps[k], refs[k], fastest)]

    for number in range(sweeps):  # sweeps over the grid, minutes apart: the fastest time of each plan counts
        if rank == 0:
            print(f"[{name}] sweep {number + 1} of {sweeps} (load {load()})", flush=True)
        sweep(list(range(len(grid))))
    # A slow spell of the machine can last through a plan's sweeps: measure again, in sweeps over the
    # plans alone, each plan with fewer than two quiet sweeps or whose two fastest quiet sweeps disagree.
    extra = []
    for number in range(EXTRA_SWEEPS):
        again = unsettled()
        if not again:
            break
        if rank == 0:
            print(f"[{name}] extra sweep {number + 1}: {len(again)} plans with fewer than 2 quiet sweeps or whose "
                  f"fastest two differ by more than {AGREE:.0%} (load {load()})", flush=True)
        extra.append(len(again))
        sweep(again)
        if len(again) - len(unsettled()) < len(again) / 10:
            break  # the machine stays in its slow state: more sweeps would settle no more
    model = build_pipe(build, size, record)
    model.step(x, y, loss_fn)
    dist.barrier()
    with trace.record(rank=rank, schedule=record.schedule, checkpoint=record.checkpoint) as recorder:
        model.step(x, y, loss_fn)
    dist.barrier()
    return {"rank": rank, "peaks": [peaks[k] for k in range(len(grid))], "steps": steps, "refs": refs,
            "extra": extra, "trace": recorder.trace()}


def run_ranks(name: str, size: dict[str, int], grid: list[Candidate], record: Candidate,
              sweeps: int) -> list[dict[str, Any]]:
    return run_local_ranks(_rank, 2, name, size, grid, record, sweeps, timeout=600.0, deadline=3000.0,
                           start_method="fork")


def timed_sweeps(result: dict[str, Any]) -> tuple[list[list[float]], float]:
    """Per plan, its sorted quiet steps (:func:`quiet_steps`), and the share of all sweeps that were quiet."""
    fastest = min(map(min, result["refs"]))
    refs = [r for plan in result["refs"] for r in plan]
    share = sum(is_quiet(r, fastest) for r in refs) / len(refs)
    return [quiet_steps(s, r, fastest) for s, r in zip(result["steps"], result["refs"])], share


def with_per_stage(costs: Costs, base: list[Candidate], budgets: list[int]) -> list[Candidate]:
    """``base`` and the per-stage recompute plans the search derives from them for ``budgets`` on 2 ranks (the
    same function it calls)."""
    plans = list(base)
    for budget in budgets:
        for c in base:
            marked = per_stage_recompute(costs, c, [budget] * 2, "processes")
            if marked is not None and marked not in plans:
                plans.append(marked)
    return plans


def per_stage_model_bound(costs: Costs, budgets: list[int], layers: int, model: planner.TimeModel
                          ) -> list[dict[str, Any]]:
    """What per-stage recompute can gain by the time model itself: at each budget, over every two-way balance
    (and the four-way one of :func:`balances_for`) with the per-stage plans derived for the budgets, the
    fastest plan whose predicted peak fits against the fastest uniform one (both predicted, with the fitted
    ``model``), where both kinds fit: the gain the model expects, to read the measured one against."""
    balances = [[k, layers - k] for k in range(1, layers)] + [b for b in balances_for(layers) if len(b) == 4]
    plans = with_per_stage(costs, candidates(costs, 2, "processes", balances=balances), budgets)
    predicted = {c: planner.predict(costs, c, runner="processes", timeline=False, model=model) for c in plans}

    def fastest(kind: list[Candidate], budget: int) -> Candidate | None:
        fitting = [c for c in kind if max(predicted[c].peaks) <= budget]
        return min(fitting, key=lambda c: predicted[c].step_time) if fitting else None

    uniform, staged = [c for c in plans if not any(c.recompute)], [c for c in plans if any(c.recompute)]
    rows = []
    for budget in budgets:
        every, one_mode = fastest(plans, budget), fastest(uniform, budget)
        if every is not None and one_mode is not None and fastest(staged, budget) is not None:
            rows.append({"budget": budget, "best_plan": every.describe(), "best_uniform_plan": one_mode.describe(),
                         "throughput_ratio": predicted[one_mode].step_time / predicted[every].step_time})
    return rows


def balances_for(layers: int) -> list[list[int]]:
    half = layers // 2
    two = [[half, layers - half], [half - 1, layers - half + 1], [half + 1, layers - half - 1]]
    q, r = divmod(layers, 4)
    four = [[q + (1 if k < r else 0) for k in range(4)]]
    return [b for b in two + four if min(b) >= 1]


def validate(name: str, size: dict[str, int], mode: dict[str, Any]) -> dict[str, Any]:
    build, data, loss_fn = MODELS[name]
    model = build(size)
    x, y = data(size)
    budgets_count = mode["budgets"]
    torch.set_num_threads(1)  # as each rank runs (one intra-op thread per rank)
    link = cached_link()
    begun = time.perf_counter()
    chunks = (size["batch"],) if name in FIXED_CHUNKS else mode["chunks"]
    costs, profiled = quiet_profile(
        lambda: planner.profile_costs(model, x, chunks, loss_fn=loss_fn, target=y, stages=2))
    balances = balances_for(len(model))
    base = candidates(costs, 2, "processes", balances=balances)
    memory = {c: planner.predict(costs, c, runner="processes", timeline=False).peaks for c in base}
    default_model = planner.TimeModel.measured(link)  # the link and overhead measured once on the machine
    # The budgets run from the smallest peak to the peak of the plan predicted fastest without a limit:
    # above it every budget is the same decision, below it memory decides.
    lo, most = min(max(p) for p in memory.values()), max(max(p) for p in memory.values())
    hi = planner.search(costs, 2, most, runner="processes", balances=balances, model=default_model).best.peak
    hi = hi if hi > lo else most
    budgets = [int(lo + (hi - lo) * k / (budgets_count - 1)) for k in range(budgets_count)]
    grid = with_per_stage(costs, base, budgets)
    planning_s = time.perf_counter() - begun
    recorded = planner.search(costs, 2, budgets[budgets_count // 2], runner="processes", balances=balances,
                              model=default_model)

    print(f"[{name}] {len(grid)} candidates ({len(grid) - len(base)} with per-stage recompute); running each on "
          f"2 ranks, {mode['sweeps']} sweeps ...", flush=True)
    run_begun = time.perf_counter()
    ranks = run_ranks(name, size, grid, recorded.candidate, mode["sweeps"])
    run_s = time.perf_counter() - run_begun
    predicted = {c: planner.predict(costs, c, runner="processes", timeline=False) for c in grid}
    measured_peak = {c: [predicted[c].static[r] + ranks[r]["peaks"][k] for r in range(2)]
                     for k, c in enumerate(grid)}
    # A plan's step is the fastest of its sweeps taken while the machine ran in its fast state (reference()).
    sweeps_of, quiet_share = timed_sweeps(ranks[0])
    measured_time = {c: sweeps_of[k][0] for k, c in enumerate(grid)}
    sweep_spread = [max(ranks[0]["steps"][k]) / measured_time[c] - 1 for k, c in enumerate(grid)]
    # How well the fastest sweep measures a plan: the next fastest quiet sweep's step over it (the step of a
    # sweep is its slower rank's). A predicted step's error within this cannot be told from the measurement's.
    sweep_second_gap = [steps[1] / steps[0] - 1 for steps in sweeps_of]

    # Time: fit overhead per action and contention on a few plans, predict every other one.
    fitted_on = calibration_plans(grid, costs)  # the plans pipe.plan.plan(calibrate=True) would run
    fitted = planner.fit(costs, {c: measured_time[c] for c in fitted_on}, runner="processes", link=link)
    timed = {c: planner.predict(costs, c, runner="processes", timeline=False, model=fitted).step_time for c in grid}
    bare = {c: planner.predict(costs, c, runner="processes", timeline=False, model=default_model).step_time
            for c in grid}
    plan_times = [{"plan": c.describe(), "predicted_ms": timed[c] * 1e3, "measured_ms": measured_time[c] * 1e3,
                   "error": timed[c] / measured_time[c] - 1, "unfitted_error": bare[c] / measured_time[c] - 1,
                   "fitted_on": c in fitted_on, "second_sweep_gap": gap} for c, gap in zip(grid, sweep_second_gap)]
    validation_errors = [abs(t["error"]) for t in plan_times if not t["fitted_on"]]
    # Each plan's error beyond its own measurement's uncertainty (0 where the prediction lies within it).
    beyond = [max(0.0, abs(t["error"]) - t["second_sweep_gap"]) for t in plan_times if not t["fitted_on"]]

    memory_errors = [predicted[c].peaks[r] / measured_peak[c][r] - 1 for c in grid for r in range(2)]
    worst = sorted(((predicted[c].peaks[r] / measured_peak[c][r] - 1, c.describe(), r, predicted[c].peaks[r],
                     measured_peak[c][r]) for c in grid for r in range(2)), key=lambda w: -abs(w[0]))[:5]

    def fastest(plans: list[Candidate], budget: int) -> Candidate | None:
        fitting = [c for c in plans if max(measured_peak[c]) <= budget]
        return min(fitting, key=lambda c: measured_time[c]) if fitting else None

    rows = []
    for budget in budgets:
        try:
            chosen = planner.search(costs, 2, budget, runner="processes", balances=balances, model=fitted).candidate
        except planner.PlanError as error:
            rows.append({"budget": budget, "plan": None, "error": str(error)})
            continue
        best = fastest(grid, budget)
        rows.append({
            "budget": budget, "plan": chosen.describe(),
            "predicted_peak": predicted[chosen].peaks, "measured_peak": measured_peak[chosen],
            "under_budget": max(measured_peak[chosen]) <= budget,
            "peak_error": max(abs(p / m - 1) for p, m in zip(predicted[chosen].peaks, measured_peak[chosen])),
            "predicted_ms": timed[chosen] * 1e3, "measured_ms": measured_time[chosen] * 1e3,
            "best_grid_plan": best.describe() if best else None,
            "best_grid_ms": measured_time[best] * 1e3 if best else None,
            "slower_than_best": measured_time[chosen] / measured_time[best] - 1 if best else None,
        })
    planned_rows = [r for r in rows if r["plan"] is not None]
    slower_grid = [r["slower_than_best"] for r in planned_rows if r["slower_than_best"] is not None]
    # Where the chosen plan is not the fastest the grid measured, the two are timed again head to head
    # (alternating, more sweeps): plans a few percent apart swap places between sweeps of the grid.
    duels = sorted({(r["plan"], r["best_grid_plan"]) for r in planned_rows
                    if r["best_grid_plan"] not in (None, r["plan"])})
    by_name = {c.describe(): c for c in grid}
    dueling = sorted({by_name[plan] for pair in duels for plan in pair}, key=lambda c: c.describe())
    duel_time: dict[str, float] = {}
    if dueling:
        print(f"[{name}] {len(duels)} chosen plans differ from the grid's fastest: timing {len(dueling)} plans "
              f"head to head, {mode['sweeps'] + 2} sweeps ...", flush=True)
        again = run_ranks(name, size, dueling, recorded.candidate, mode["sweeps"] + 2)
        duel_time = {c.describe(): timed_sweeps(again[0])[0][k][0] for k, c in enumerate(dueling)}
    for r in planned_rows:
        r["slower_than_best_grid"] = r["slower_than_best"]
        if r["best_grid_plan"] not in (None, r["plan"]):
            r["duel_ms"] = [duel_time[r["plan"]] * 1e3, duel_time[r["best_grid_plan"]] * 1e3]
            r["slower_than_best"] = duel_time[r["plan"]] / duel_time[r["best_grid_plan"]] - 1
    slower = [r["slower_than_best"] for r in planned_rows if r["slower_than_best"] is not None]

    # Per-stage recompute against one checkpoint mode for every stage, measured: at each budget where both
    # kinds of plan fit when run, the fastest fitting plan of all against the fastest uniform one.
    uniform = [c for c in grid if not any(c.recompute)]
    per_stage_rows = []
    for budget in budgets:
        every, one_mode, staged = fastest(grid, budget), fastest(uniform, budget), fastest(
            [c for c in grid if any(c.recompute)], budget)
        if every is not None and one_mode is not None and staged is not None:
            per_stage_rows.append({
                "budget": budget, "best_plan": every.describe(), "best_ms": measured_time[every] * 1e3,
                "best_uniform_plan": one_mode.describe(), "best_uniform_ms": measured_time[one_mode] * 1e3,
                "best_per_stage_plan": staged.describe(), "best_per_stage_ms": measured_time[staged] * 1e3,
                "throughput_ratio": measured_time[one_mode] / measured_time[every]})
    per_stage = per_stage_rows[0] if per_stage_rows else None  # the tightest budget where a per-stage plan fits
    bound_rows = per_stage_model_bound(costs, budgets, len(model), fitted)

    middle = planner.search(costs, 2, budgets[budgets_count // 2], runner="processes", balances=balances,
                            model=fitted)
    merged = trace.merge([r["trace"] for r in ranks])
    explanation = planner.explain(merged)
    return {
        "size": size, "layers": len(model), "candidates": len(grid), "planning_s": planning_s, "run_s": run_s,
        "extra_sweeps": ranks[0]["extra"], "quiet_share": quiet_share, "profile": profiled,
        "reference_ms": {"fastest": min(map(min, ranks[0]["refs"])) * 1e3,
                         "median": statistics.median(r for refs in ranks[0]["refs"] for r in refs) * 1e3},
        "link": {"latency_us": link.latency * 1e6 if link else None, "ns_per_byte": link.per_byte * 1e9 if link else None,
                 "action_overhead_ms": link.action_overhead * 1e3 if link else None,
                 "source": link.source if link else None},
        "time_model": {"action_overhead_ms": fitted.action_overhead * 1e3,
                       "message_overhead_ms": fitted.message_overhead * 1e3, "contention": fitted.contention,
                       "fitted_on": [c.describe() for c in fitted_on],
                       # What a checkpointed cell adds beyond its forwards again (profiled).
                       "checkpoint_overhead_ms": costs.checkpoint_overhead * 1e3},
        "step_error_worst": max(validation_errors) if validation_errors else None,
        "step_error_median": statistics.median(validation_errors) if validation_errors else None,
        "step_error_p90": p90(validation_errors) if validation_errors else None,
        "sweep_spread_median": statistics.median(sweep_spread), "sweep_spread_max": max(sweep_spread),
        "sweep_second_gap_median": statistics.median(sweep_second_gap), "sweep_second_gap_p90": p90(sweep_second_gap),
        "sweep_second_gap_max": max(sweep_second_gap),
        "step_error_beyond_gap_worst": max(beyond) if beyond else None,
        "step_error_within_gap_share": sum(b == 0.0 for b in beyond) / len(beyond) if beyond else None,
        "step_error_worst_fitted": max(abs(t["error"]) for t in plan_times if t["fitted_on"]),
        "step_error_worst_unfitted_model": max(abs(t["unfitted_error"]) for t in plan_times),
        "step_error_median_unfitted_model": statistics.median(abs(t["unfitted_error"]) for t in plan_times),
        "chosen_within_5pct": sum(s_ <= 0.05 for s_ in slower) / len(slower) if slower else None,
        "chosen_within_5pct_grid": sum(s_ <= 0.05 for s_ in slower_grid) / len(slower_grid) if slower_grid else None,
        "duels": [{"chosen": a, "fastest_in_grid": b, "chosen_ms": duel_time[a] * 1e3, "fastest_in_grid_ms": duel_time[b] * 1e3}
                  for a, b in duels],
        "chosen_slower_than_best_max": max(slower) if slower else None,
        "fit_share": sum(r["under_budget"] for r in planned_rows) / len(planned_rows) if planned_rows else None,
        "per_stage_vs_uniform": per_stage["throughput_ratio"] if per_stage else None,
        "per_stage_detail": per_stage,
        "per_stage_vs_uniform_max": max(r["throughput_ratio"] for r in per_stage_rows) if per_stage_rows else None,
        "per_stage_budgets": per_stage_rows,
        # The same by the model's own predictions, over every two-way balance (per_stage_model_bound).
        "per_stage_vs_uniform_model": bound_rows[0]["throughput_ratio"] if bound_rows else None,
        "per_stage_vs_uniform_model_max": max(r["throughput_ratio"] for r in bound_rows) if bound_rows else None,
        "per_stage_model_budgets": bound_rows,
        "peak_error_max_all_plans": max(abs(e) for e in memory_errors),
        "peak_error_median_all_plans": statistics.median(abs(e) for e in memory_errors),
        "peak_error_worst": [{"error": e, "plan": d, "rank": r, "predicted": p, "measured": m}
                             for e, d, r, p, m in worst],
        "budgets": rows,
        "plan_times": plan_times,
        "middle_budget_plan": middle.table(),
        "explained": {"plan": recorded.candidate.describe(), "rows": explanation.summary(),
                      "attributed_min": min(explanation.attributed(r) for r in range(len(explanation.rows))),
                      "table": explanation.table()},
    }


def planning_scaling() -> list[dict[str, Any]]:
    """Seconds to plan tabled models of 25 to 100 layers (no profiling: the search alone)."""
    found = []
    for layers in (25, 50, 100):
        costs = Costs.from_table(64, [1e-5 * (1 + k % 3) for k in range(layers)], [2e-5] * layers,
                                 [4096] * layers, [1024] * layers, param_bytes=[10**6] * layers)
        for stages in (4, 8):
            even = [layers // stages + (1 if k < layers % stages else 0) for k in range(stages)]
            tight = planner.predict(costs, Candidate("gpipe", 8, tuple(even), "always"), runner="processes").peak
            begun = time.perf_counter()
            chosen = planner.search(costs, stages, int(tight * 1.05), runner="processes")
            found.append({"layers": layers, "stages": stages, "seconds": time.perf_counter() - begun,
                          "candidates": chosen.considered, "simulated": chosen.simulated})
            print(f"planning {layers} layers over {stages} stages: {found[-1]['seconds']:.2f} s "
                  f"({chosen.considered} candidates, {chosen.simulated} simulated)", flush=True)
    return found


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer chunks and budgets")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--budgets", type=int, help="budgets per model (default 20, quick 8)")
    parser.add_argument("--sweeps", type=int, help="sweeps over the grid (default 3, quick 2)")
    args = parser.parse_args(argv)
    if args.sweeps is not None and args.sweeps < 2:
        parser.error(f"--sweeps must be at least 2 (how closely the fastest sweep measures a plan needs a second), "
                     f"got {args.sweeps}")
    kind = "quick" if args.quick else "full"
    sizes, mode = SIZES[kind], dict(MODES[kind])
    mode.update({k: v for k, v in (("budgets", args.budgets), ("sweeps", args.sweeps)) if v is not None})
    begun = time.perf_counter()
    result: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "load_before": load(),
                    "note": "2 gloo ranks on a shared CPU machine; wall-clock times are noisy"},
        "mode": kind, "settings": mode,
        "targets": {"step_error_worst": "<= 0.10", "chosen_within_5pct": ">= 0.90", "fit_share": "1.0",
                    "per_stage_vs_uniform": ">= 1.15"},
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("planner-quick.json" if args.quick else "planner.json")
    for name in args.models:
        r = validate(name, sizes[name], mode)
        result[name] = r
        path.write_text(json.dumps(result, indent=2))  # each model as it finishes: a long run keeps what it did
        print(f"\n== {name}: {r['layers']} layers, {r['candidates']} candidates, profiled in {r['planning_s']:.1f} s, "
              f"run in {r['run_s']:.0f} s")
        print(f"time model: link {r['link']['latency_us']:.1f} us + {r['link']['ns_per_byte']:.3f} ns/B; overhead "
              f"{r['time_model']['action_overhead_ms']:.3f} ms/action, "
              f"{r['time_model']['message_overhead_ms']:.3f} ms/message, contention x{r['time_model']['contention']:.3f} "
              f"(fitted on {len(r['time_model']['fitted_on'])} plans)")
        for t in r["plan_times"]:
            print(f"  {t['plan']:<70} predicted {t['predicted_ms']:8.2f} ms  measured {t['measured_ms']:8.2f} ms  "
                  f"error {t['error']:+6.1%}{'  (fitted on)' if t['fitted_on'] else ''}")
        print(f"step_error_worst {r['step_error_worst']:.1%} (median {r['step_error_median']:.1%}) over "
              f"{r['candidates'] - len(r['time_model']['fitted_on'])} plans not fitted on; "
              f"chosen_within_5pct {r['chosen_within_5pct']:.0%}; fit_share {r['fit_share']:.0%}; "
              f"per_stage_vs_uniform {r['per_stage_vs_uniform']} (max over budgets {r['per_stage_vs_uniform_max']}); "
              f"by the model itself, over every two-way balance: {r['per_stage_vs_uniform_model']} "
              f"(max {r['per_stage_vs_uniform_model_max']})")
        for duel in r["duels"]:
            print(f"head to head: chosen {duel['chosen']} {duel['chosen_ms']:.2f} ms, the grid's fastest "
                  f"{duel['fastest_in_grid']} {duel['fastest_in_grid_ms']:.2f} ms")
        print(f"chosen within 5% by the grid's times alone: {r['chosen_within_5pct_grid']:.0%}")
        print(f"slowest sweep's best vs fastest, per plan: median +{r['sweep_spread_median']:.0%}, "
              f"max +{r['sweep_spread_max']:.0%} (the measurement's own spread)")
        print(f"second fastest sweep vs fastest, per plan: median +{r['sweep_second_gap_median']:.1%}, "
              f"p90 +{r['sweep_second_gap_p90']:.1%}, max +{r['sweep_second_gap_max']:.1%} (the uncertainty of the "
              "fastest sweep as a plan's step: errors within it cannot be told from the measurement's)")
        if r["step_error_within_gap_share"] is not None:
            print(f"plans not fitted on whose error is within their own gap: {r['step_error_within_gap_share']:.0%}; "
                  f"the worst error beyond it: {r['step_error_beyond_gap_worst']:.1%}")
        print(f"predicted vs measured peak, all plans and ranks: max {r['peak_error_max_all_plans']:.2%}, "
              f"median {r['peak_error_median_all_plans']:.2%}")
        print(r["middle_budget_plan"])
        print(r["explained"]["table"])
    result["planning_scaling"] = planning_scaling()
    result["machine"]["load_after"] = load()
    result["seconds"] = time.perf_counter() - begun
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path} in {result['seconds']:.0f} s (load before {result['machine']['load_before']}, "
          f"after {result['machine']['load_after']})")

