"""Tests for pipe.threads.pipeline: the clock cycles the thread runner reads from each partition's program."""
from __future__ import annotations

import pytest

from pipe.core.schedule import Schedule
from pipe.threads.pipeline import clock_cycles


def test_gpipe_cycles_are_the_diagonals() -> None:
    assert clock_cycles(2, 3) == [[(0, 0)], [(0, 1), (1, 0)], [(1, 1), (2, 0)], [(2, 1)]]


@pytest.mark.parametrize("partitions, chunks", [(1, 1), (1, 4), (2, 1), (3, 5), (4, 8), (5, 2)])
def test_cycles_match_the_schedules_simulated_cycles(partitions: int, chunks: int) -> None:
    # The runner derives its cycles from Schedule.actions() per partition; the simulation agrees.
    simulated = [[(a.microbatch, a.stage) for a in cycle]
                 for cycle in Schedule("gpipe", ranks=partitions, microbatches=chunks).forward_clock_cycles()]
    assert clock_cycles(partitions, chunks) == simulated
    cells = [cell for cycle in clock_cycles(partitions, chunks) for cell in cycle]
    assert sorted(cells) == [(i, j) for i in range(chunks) for j in range(partitions)]
