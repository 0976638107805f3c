"""The time model of a cut (pipe.core.stage_costs): each action's and message's cost, and the bound no order beats."""
from __future__ import annotations

import pytest

from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.stage_costs import StageCosts, busy_bound, lowered_step, message_cost


def test_a_recompute_and_a_gradient_message_cost_what_was_measured_else_the_forward_and_the_transfer() -> None:
    plain = StageCosts.of([1.0, 2.0], [1.0, 1.0], [1.0, 1.0], transfer=0.25)
    assert plain.recompute == plain.forward and plain.gradient == plain.transfer
    measured = StageCosts.of([1.0, 2.0], [1.0, 1.0], [1.0, 1.0], transfer=0.25, recompute=[1.5, 2.5], gradient=0.125)
    assert [measured.cost("R", s) for s in range(2)] == [1.5, 2.5]
    schedule = Schedule("1f1b", 2, 2)
    sent = message_cost(schedule, measured)
    assert sent(Action(Phase.FORWARD, 0, 1)) == 0.25 and sent(Action(Phase.BACKWARD, 0, 0)) == 0.125
    assert sent(Action(Phase.FORWARD, 0, 0)) == 0.0 and sent(Action(Phase.BACKWARD, 0, 1)) == 0.0
    assert lowered_step(schedule, measured, stop=2) > lowered_step(schedule, plain, stop=2)  # R costs more


def test_contention_scales_compute_not_the_runners_overhead() -> None:
    costs = StageCosts.of([1.0], [1.0], [2.0], overhead=0.5)
    assert [costs.cost(p, 0, contention=2.0) for p in "FIWBR"] == [2.5, 2.5, 4.5, 6.5, 2.0]


@pytest.mark.parametrize("kind,virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                          ("looped-bfs", 2), ("zbv", 2)])
def test_no_fixed_schedule_beats_the_bound_of_its_backward(kind: str, virtual: int) -> None:
    ranks = 2
    costs = StageCosts.of([1.0, 1.3, 0.8, 1.6][:ranks * virtual], [0.0, 1.1, 0.9, 1.2][:ranks * virtual],
                          [1.9, 2.2, 2.0, 2.5][:ranks * virtual], transfer=0.2, overhead=0.05)
    schedule = Schedule(kind, ranks, 4, virtual_stages=virtual)
    placement = [schedule.rank_of(s) for s in range(schedule.stages)]
    for stop in (0, 4):
        step = lowered_step(schedule, costs, stop)
        exact = busy_bound(costs, placement, 4, stop, splits=schedule.splits_backward)
        assert busy_bound(costs, placement, 4, stop) <= exact <= step + 1e-9
    # The bound counts the forwards before a rank's first stage: rank 1 starts after stage 0's first F.
    alone = busy_bound(StageCosts.of([1.0, 1.0], [1.0, 1.0], [1.0, 1.0]), [0, 1], 1, splits=False)
    assert alone == 1.0 + 1.0 + 2.0 + 2.0  # its F and B, and stage 0's F and B around them
