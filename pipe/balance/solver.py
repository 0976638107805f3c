"""The partition solver: cut a sequence of layer costs into k runs with the smallest largest run.

A pipeline runs at the pace of its slowest partition, so a balance is good
when the costliest partition is as cheap as possible. This is the linear
partition problem, solved exactly by dynamic programming: ``best[p][i]``, the
smallest possible largest cost of ``i`` layers in ``p`` partitions, is the
minimum over the last cut ``t`` of ``max(best[p-1][t], cost(t..i))``. The
first term grows with ``t`` and the second shrinks, so the minimum sits where
they cross and a binary search finds it: O(k n log n) instead of O(k n²).
Among equally good cuts (zero-cost layers), the one nearest an even split of
the layers is taken.
"""
from __future__ import annotations

import math
from typing import Sequence

from pipe.core.options import is_int

__all__: list[str] = []


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Splits ``costs`` into ``partitions`` non-empty runs minimising the largest run's sum.

    Usage::

        solve([1, 1, 8, 1, 1], 3)   # [2, 1, 2]

    Args:
        costs: the cost of each layer (non-negative).
        partitions: how many runs.

    Returns:
        The length of each run (a balance for ``Pipe``).

    Raises:
        ValueError: a negative or non-finite cost, or more partitions than layers.
        TypeError: ``partitions`` is not an int.
    """
    if not is_int(partitions):
        raise TypeError(f"partitions must be an int, got {partitions!r}")
    n = len(costs)
    if partitions < 1 or partitions > n:
        raise ValueError(
            f"cannot split {n} layers into {partitions} partitions; partitions must be between 1 and {n} "
            "(every partition needs at least one layer)"
        )
    for index, cost in enumerate(costs):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"layer {index} has cost {cost}; costs must be finite and non-negative")

    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))

    def run(t: int, i: int) -> float:
        return prefix[i] - prefix[t]

    inf = math.inf
    # best[p][i]: smallest largest run of layers [0, i) in p runs; cut[p][i]: where the last run starts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    for i in range(1, n + 1):
        best[1][i] = run(0, i)
    for p in range(2, partitions + 1):
        previous = best[p - 1]
        for i in range(p, n - (partitions - p) + 1):
            lo, hi = p - 1, i - 1
            while lo < hi:  # first t where the layers before outweigh the last run
                mid = (lo + hi) // 2
                if previous[mid] >= run(mid, i):
                    hi = mid
                else:
                    lo = mid + 1

            def value(t: int) -> float:
                return max(previous[t], run(t, i))

            t = lo if lo == p - 1 or value(lo) <= value(lo - 1) else lo - 1
            optimum = value(t)
            # Ties (flat stretches of zero-cost layers): take the cut nearest an even split.
            target = i * (p - 1) / p
            left, right = t, t
            while left > p - 1 and value(left - 1) == optimum:
                left -= 1
            while right < i - 1 and value(right + 1) == optimum:
                right += 1
            t = min(max(round(target), left), right)
            best[p][i] = optimum
            cut[p][i] = t

    balance: list[int] = []
    i = n
    for p in range(partitions, 0, -1):
        t = cut[p][i] if p > 1 else 0
        balance.append(i - t)
        i = t
    balance.reverse()
    return balance


def _rank_loads(costs: Sequence[float], balance: Sequence[int], rank_of: Sequence[int], ranks: int
                ) -> tuple[float, float]:
    """(the busiest rank's cost, the costliest stage's) of a cut."""
    stage, start = [], 0
    for count in balance:
        stage.append(math.fsum(costs[start:start + count]))
        start += count
    return max(math.fsum(c for s, c in enumerate(stage) if rank_of[s] == r) for r in range(ranks)), max(stage)


def cut_for_ranks(costs: Sequence[float], stages: int, rank_of: Sequence[int], ranks: int) -> list[list[int]]:
    """Cuts of the layers (cost ``costs``) into ``stages`` run by ``ranks`` (stage s on rank ``rank_of[s]``):
    :func:`solve`'s (the costliest stage as cheap as possible), and that cut moved one boundary at a time
    while the busiest rank gets lighter (in a V the first and the last stage share rank 0, so they get fewer
    layers). One cut where both are the same."""
    first = solve(costs, stages)
    cut, best = list(first), _rank_loads(costs, first, rank_of, ranks)
    improved = True
    while improved:
        improved = False
        for k in range(stages - 1):
            for step in (-1, 1):
                moved = list(cut)
                moved[k] += step
                moved[k + 1] -= step
                if min(moved) < 1:
                    continue
                load = _rank_loads(costs, moved, rank_of, ranks)
                if load < best:
                    cut, best, improved = moved, load, True
    return [first] if cut == first else [first, cut]
