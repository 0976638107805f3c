"""Every prediction, search and cost-shaped order of a fixed set of cost tables, as JSON: a refactor's before/after.

A change to the planner or the time model that should not move a number is
checked by recording these on the tree before and after it and comparing the
files (``--compare``). Recorded:

* ``predict``: for two cost tables (4 equal layers; 6 uneven ones), both runners
  and three time models (layer times alone; a link with overheads; ranks sharing
  one core), every candidate's predicted step, peaks, static bytes and search
  bound;
* ``search``: the plan chosen for three budgets of each;
* ``orders``: ``schedule_from_costs`` on 12 random 2- and 4-stage costs.

Run from the repository root:
    PYTHONPATH=. python benchmarks/planner_records.py before.json     # on the old tree
    PYTHONPATH=. python benchmarks/planner_records.py after.json      # on the new one
    python benchmarks/planner_records.py --compare before.json after.json
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def record(path: str) -> None:
    from plan.test_search import table

    from pipe.core.cost_order import schedule_from_costs
    from pipe.core.stage_costs import StageCosts, lowered_step
    from pipe.plan import Link, TimeModel, predict, search
    from pipe.plan.candidates import candidates
    from pipe.plan.predict import busy_bound

    out: dict[str, list[Any]] = {"predict": [], "search": [], "orders": []}
    models = {"alone": None,
              "link": TimeModel(link=Link(2e-4, 1e-9), action_overhead=1e-4, contention=1.2, message_overhead=5e-5),
              "cores": TimeModel(link=Link(2e-4, 1e-9), action_overhead=1e-4, contention=1.2, cores=1)}
    for forward in ([1e-3] * 4, [1e-3, 2e-3, 1e-3, 6e-3, 3e-3, 1e-3]):
        costs = table(forward)
        for runner in ("threads", "processes"):
            for name, model in models.items():
                for c in candidates(costs, 2, runner):
                    p = predict(costs, c, runner=runner, timeline=False, model=model)
                    out["predict"].append([repr(c), runner, name, p.step_time, p.peaks, p.static,
                                           busy_bound(costs, c, model)])
                for budget in ("1GiB", 20000, 12000):
                    try:
                        plan = search(costs, 2, budget, runner=runner, model=model)
                        out["search"].append([str(forward), runner, name, budget, repr(plan.candidate),
                                              plan.best.step_time])
                    except ValueError as error:
                        out["search"].append([str(forward), runner, name, budget, type(error).__name__,
                                              str(error)[:200]])
    rng = random.Random(5)
    for _ in range(12):
        stages = rng.choice([2, 4])
        costs_ = StageCosts.of([rng.uniform(0.5, 2) for _ in range(stages)], [rng.uniform(0.5, 2) for _ in range(stages)],
                               [rng.uniform(0.5, 2) for _ in range(stages)], transfer=rng.choice([0.0, 0.1]),
                               overhead=rng.choice([0.0, 0.05]))
        order = schedule_from_costs(costs_, ranks=2, microbatches=rng.choice([2, 4, 6]))
        out["orders"].append([order.name, [[str(a) for a in p] for p in order.programs], lowered_step(order, costs_)])
    Path(path).write_text(json.dumps(out, indent=0) + "\n")
    print(f"{path}: " + ", ".join(f"{len(v)} {k}" for k, v in out.items()))


def compare(before: str, after: str, rounding: float = 1e-12) -> int:
    """Prints, per part, how many records differ at all and how many beyond ``rounding`` (relative, in a time);
    returns 1 if a plan, an order, a peak or a time differs beyond it."""
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())

    def close(x: Any, y: Any) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return abs(x - y) <= rounding * max(abs(x), abs(y))
        if isinstance(x, list) and isinstance(y, list):
            return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
        return bool(x == y)

    beyond = 0
    for key in a:
        exact = sum(x != y for x, y in zip(a[key], b[key]))
        far = sum(not close(x, y) for x, y in zip(a[key], b[key])) + abs(len(a[key]) - len(b[key]))
        beyond += far
        print(f"{key}: {len(a[key])} records before, {len(b[key])} after; {exact} differ, {far} beyond rounding "
              f"({rounding:g} relative)")
    return 1 if beyond else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    record(sys.argv[1])
