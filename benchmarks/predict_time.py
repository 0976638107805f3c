"""How long the planner's predictions take: CPU seconds to predict every candidate of a small cost table.

The candidates are those of ``pipe.plan.candidates.candidates`` for 4 equal layers (tests/plan/test_search.py's
table) on 2 ranks for the process runner (119 plans: every schedule, chunk count, balance and checkpoint mode),
predicted under three time models: the layer times alone, a link with per-action overheads, and ranks sharing
one core. "cold" empties the cache of lowered programs first (every table lowered again), "warm" does not.
CPU time (``time.process_time``), the least of the repeats: on a shared machine the wall clock measures the
others. Run from the repository root, alternating trees to compare them::

    PYTHONPATH=. python benchmarks/predict_time.py 5
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from plan.test_search import table  # noqa: E402
from pipe.plan import Link, TimeModel, predict  # noqa: E402
from pipe.plan.candidates import candidates  # noqa: E402


def forget_lowered() -> None:
    import pipe.core.program_time as program_time

    program_time._lowered.cache_clear()
    program_time._lowered_rank.cache_clear()


def main(repeats: int) -> None:
    costs = table([1e-3] * 4)
    found = candidates(costs, 2, "processes")
    models = {"layers alone": None,
              "link": TimeModel(link=Link(2e-4, 1e-9), action_overhead=1e-4, contention=1.2, message_overhead=5e-5),
              "shared cores": TimeModel(link=Link(2e-4, 1e-9), action_overhead=1e-4, contention=1.2, cores=1)}
    for name, model in models.items():
        seconds: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(repeats):
            for mode in seconds:
                if mode == "cold":
                    forget_lowered()
                start = time.process_time()
                for candidate in found:
                    predict(costs, candidate, runner="processes", timeline=False, model=model)
                seconds[mode].append(time.process_time() - start)
        print(f"{name:12s} {len(found)} candidates: " + ", ".join(
            f"{mode} {min(s):.4f} s (up to {max(s):.4f})" for mode, s in seconds.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
