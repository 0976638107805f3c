"""pipe.plan.auto_schedule, the planner without a budget: the cut and the order from per-layer F, I and W (given
here, so the test is exact; tests/distributed/test_auto_ranks.py times a model and runs the result)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipe.balance import LayerTimes
from pipe.balance.solver import cut_for_ranks
from pipe.core.message import HEADER_BYTES
from pipe.core.stage_costs import lowered_step
from pipe.plan import Costs, Link, auto_schedule


def _times(forward: list[float], input_grad: list[float], weight_grad: list[float]) -> LayerTimes:
    n = len(forward)
    return LayerTimes({4: forward}, {4: [i + w for i, w in zip(input_grad, weight_grad)]}, {4: input_grad},
                      {4: [1000] * n}, 3, weight_grad={4: weight_grad})


def _model(layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


def test_a_heavy_head_gets_a_stage_of_its_own_and_the_result_beats_an_even_cut() -> None:
    # Ten blocks and a head that costs four of them (an LM head and its loss).
    forward = [1.0] * 10 + [4.0]
    times = _times(forward, [1.0] * 11, [2.0] * 10 + [8.0])
    auto = auto_schedule(_model(11), ranks=2, chunks=8, times=times)
    assert sum(auto.balance) == 11 and len(auto.balance) == auto.schedule.stages
    last_rank = auto.schedule.rank_of(auto.schedule.stages - 1)
    layers_with_head = sum(n for s, n in enumerate(auto.balance) if auto.schedule.rank_of(s) == last_rank)
    assert layers_with_head < 11 / 2  # the rank holding the head holds fewer layers
    even = Costs.from_layer_times(times, 8).stage_costs([(0, 6), (6, 11)], 8)
    from pipe.core.schedule import Schedule

    assert auto.step < lowered_step(Schedule("zb-h1", 2, 8), even)
    assert auto.bound <= auto.step
    assert lowered_step(auto.schedule, auto.costs) == pytest.approx(auto.step)


def test_the_v_cut_balances_ranks_not_stages() -> None:
    totals = [3.0] + [1.0] * 14 + [3.0]  # embedding and head: the first and the last stage share rank 0 in a V
    rank_of = [0, 1, 1, 0]
    cuts = cut_for_ranks(totals, 4, rank_of, 2)
    best = cuts[-1]

    def load(rank: int) -> float:
        bounds = [sum(best[:k]) for k in range(5)]
        return sum(sum(totals[bounds[s]:bounds[s + 1]]) for s in range(4) if rank_of[s] == rank)

    assert abs(load(0) - load(1)) <= 1.0 and sum(best) == 16


def test_layer_times_put_the_first_stage_backward_in_its_w() -> None:
    costs = Costs.from_layer_times(_times([1.0] * 4, [0.5] * 4, [2.0] * 4), 4)
    stages = costs.stage_costs([(0, 2), (2, 4)], 4, message=Link(0.5, 1e-3).cost)
    assert stages.input_grad == (0.0, 1.0) and stages.weight_grad == (5.0, 4.0)
    assert stages.transfer == (pytest.approx(0.5 + 1e-3 * (HEADER_BYTES + 1000)),)


def test_the_planner_without_a_budget_is_auto_schedule() -> None:
    """auto_schedule's choice is the search's over the cost-shaped orders, with no budget: the same cut and step."""
    from pipe.plan import search
    from pipe.plan.timing import TimeModel

    times = _times([1.0] * 10 + [4.0], [1.0] * 11, [2.0] * 10 + [8.0])
    auto = auto_schedule(_model(11), ranks=2, chunks=8, times=times, action_seconds=0.01)
    plan = search(Costs.from_layer_times(times, 8), 2, runner="processes", schedules=["auto", "auto-v"],
                  checkpoints=["never"], model=TimeModel(action_overhead=0.01))
    assert list(plan.candidate.balance) == auto.balance and plan.best.step_time == auto.step
    assert plan.table().startswith("no memory budget;"), plan.table()


@pytest.mark.parametrize("call, message", [
    (lambda: auto_schedule(_model(4), ranks=2, chunks=4), r"needs sample="),
    (lambda: auto_schedule(_model(1), torch.randn(4, 4), ranks=2, chunks=4), r"cannot cut 1 layers"),
    (lambda: auto_schedule(_model(3), ranks=2, chunks=4, placement="v",
                           times=_times([1.0] * 3, [1.0] * 3, [1.0] * 3)), r"placement='v' needs 4 layers"),
    (lambda: Costs.from_layer_times(LayerTimes({4: [1.0]}, {4: [1.0]}, {}, {4: [1]}, 1), 4), r"split=True"),
    (lambda: Costs.from_layer_times(LayerTimes({0: [1.0]}, {0: [1.0]}, {0: [0.5]}, {0: [1]}, 1,
                                               weight_grad={0: [0.5]}), 4), r"keyed by 0 rows; key them by the"),
    (lambda: auto_schedule(_model(4), ranks=2, chunks=4, placement="ring"), r"placement must be one of"),
    (lambda: auto_schedule(_model(4), ranks=2, chunks=4, checkpoint="maybe"), r"checkpoint must be one of"),
])
def test_bad_input_is_refused_with_the_fix(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_auto_schedule_times_a_real_model() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), *[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)],
                          nn.Linear(16, 50))
    auto = auto_schedule(model, torch.randint(0, 50, (8, 5)), ranks=2, chunks=4, timeout=0.01)
    assert sum(auto.balance) == len(model) and auto.schedule.microbatches == 4
    auto.schedule.validate()
