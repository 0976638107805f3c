"""The partition solver: exact min-max against brute force, ties, errors."""
from __future__ import annotations

import itertools
import random

import pytest

from pipe.balance.solver import solve


def largest(costs: list[float], balance: list[int]) -> float:
    start, worst = 0, 0.0
    for size in balance:
        worst = max(worst, sum(costs[start:start + size]))
        start += size
    return worst


def brute_force(costs: list[float], k: int) -> float:
    n = len(costs)
    return min(largest(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 5.0, rng.random() * 10]) for _ in range(n)]
        balance = solve(costs, k)
        assert len(balance) == k and sum(balance) == n and min(balance) >= 1
        assert largest(costs, balance) == pytest.approx(brute_force(costs, k))


def test_examples() -> None:
    assert solve([1, 1, 8, 1, 1], 3) == [2, 1, 2]
    assert solve([1, 0, 100, 1, 0, 1], 3) == [2, 1, 3]  # the heavy layer alone
    assert solve([1] * 10, 4) in ([2, 3, 3, 2], [3, 3, 2, 2], [2, 2, 3, 3], [3, 2, 2, 3])
    assert solve([0] * 6, 3) == [2, 2, 2]  # ties: an even split of layers
    assert solve([7], 1) == [1]


def test_long_sequence_is_fast_enough() -> None:
    costs = [float((i * 7919) % 13) for i in range(2000)]
    balance = solve(costs, 16)
    assert sum(balance) == 2000 and largest(costs, balance) <= sum(costs) / 16 + 12


def test_errors() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 partitions"):
        solve([1, 2], 3)
    with pytest.raises(ValueError, match="layer 1 has cost -1"):
        solve([1, -1], 1)
    with pytest.raises(ValueError, match="layer 0 has cost nan"):
        solve([float("nan")], 1)
    with pytest.raises(TypeError, match="partitions must be an int"):
        solve([1], 1.0)  # type: ignore[arg-type]
