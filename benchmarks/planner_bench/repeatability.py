"""How far the planner benchmark's measurement of one plan moves between runs.

`python benchmarks/planner.py budget` times every plan of its grid (the fastest of 3 steps
in each of 3 sweeps) and compares the planner's prediction with it. Its
target for the prediction is a worst error of 10%. This script reads the
versions of `benchmarks/results/planner.json` committed to git (each one run
of the benchmark) and, for every plan measured in at least three of them,
compares its measured step across the runs: the largest over the smallest,
and the coefficient of variation. A prediction (a fixed function of the
profile) cannot be shown to come within less than this of every run's
measurement. The code changed between the runs too, so the figures are also
given for the plain plans alone (GPipe, 1F1B and interleaved, checkpoint
"never", no recompute marks), whose runner path changed least: there the
spread is mostly the machine's.

Run:
    python benchmarks/planner.py repeatability            # the last 8 committed runs
    python benchmarks/planner.py repeatability --runs 12
Results: printed, and saved to benchmarks/results/planner_repeatability.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
RESULT = "benchmarks/results/planner.json"
MODELS = ("mlp", "transformer", "transformer-long")


def committed_runs(count: int) -> list[tuple[str, dict]]:
    """The last ``count`` committed versions of planner.json, newest first, as (commit, result)."""
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=HERE, text=True).strip()
    commits = subprocess.check_output(["git", "log", "--format=%h", "-n", str(count), "--", RESULT],
                                      cwd=root, text=True).split()
    runs = []
    for commit in commits:
        text = subprocess.check_output(["git", "show", f"{commit}:{RESULT}"], cwd=root, text=True)
        runs.append((commit, json.loads(text)))
    return runs


def plain(plan: str) -> bool:
    """A plan without checkpointing, recompute marks or a split backward."""
    return plan.split()[0] in ("gpipe", "1f1b", "interleaved") and "checkpoint=never" in plan and "recompute" not in plan


def spread(runs: list[tuple[str, dict]], model: str, only_plain: bool = False) -> dict:
    measured: dict[str, list[float]] = defaultdict(list)
    for _, result in runs:
        for row in result.get(model, {}).get("plan_times", []):
            if plain(row["plan"]) or not only_plain:
                measured[row["plan"]].append(row["measured_ms"])
    repeated = {plan: times for plan, times in measured.items() if len(times) >= 3}
    if not repeated:
        return {"plans": 0}
    ratios = sorted(max(t) / min(t) - 1 for t in repeated.values())
    variation = sorted(statistics.stdev(t) / statistics.mean(t) for t in repeated.values())
    return {"plans": len(repeated), "runs_per_plan_median": statistics.median(len(t) for t in repeated.values()),
            "max_over_min_median": statistics.median(ratios), "max_over_min_p90": ratios[int(0.9 * (len(ratios) - 1))],
            "max_over_min_max": ratios[-1], "cv_median": statistics.median(variation)}


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8, help="committed runs to read (default 8)")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error(f"--runs must be at least 3 (a spread needs three runs of a plan), got {args.runs}")
    runs = committed_runs(args.runs)
    if len(runs) < 3:
        raise SystemExit(f"found {len(runs)} committed versions of {RESULT}; this needs at least 3")
    result = {"commits": [commit for commit, _ in runs], "models": {m: spread(runs, m) for m in MODELS},
              "plain_plans": {m: spread(runs, m, only_plain=True) for m in MODELS}}
    for kind, rows in (("", result["models"]), ("plain ", result["plain_plans"])):
        for model, row in rows.items():
            if row["plans"]:
                print(f"{model}: {row['plans']} {kind}plans measured in {row['runs_per_plan_median']:.0f} runs (median); "
                      f"largest / smallest measured step, median +{row['max_over_min_median']:.0%}, "
                      f"p90 +{row['max_over_min_p90']:.0%}, max +{row['max_over_min_max']:.0%}; "
                      f"coefficient of variation, median {row['cv_median']:.1%}")
    out = HERE / "results" / "planner_repeatability.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")

