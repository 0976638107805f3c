"""pipe.balance.traced_step: each stage's median F, I, W and the runner's time per action from recorded spans
(built here, so the test is exact), the time model read off them (pipe.plan.timing.recorded_phases, fit with
traced=), and auto_schedule(measured=) ordering by it.
tests/distributed/test_auto_ranks.py records a real step on gloo ranks and runs the order made from it."""
from __future__ import annotations

import json
from typing import Any

import pytest
from torch import nn

from pipe.balance import LayerTimes, traced_step
from pipe.plan import auto_schedule
from pipe.plan import Candidate, fit
from pipe.plan.cost import Costs
from pipe.plan.timing import recorded_phases
from pipe.core.stage_costs import StageCosts, lowered_step
from pipe.core.action import Phase
from pipe.core.schedule import Schedule
from pipe.trace import TraceError, complete_event

KIND = {Phase.FORWARD: "forward", Phase.INPUT: "input", Phase.WEIGHT: "weight", Phase.BACKWARD: "backward"}


def _recorded(schedule: Schedule, cost: dict[tuple[str, int], list[float]], steps: int = 2, gap: float = 10.0,
              wait: float = 0.0) -> list[dict[str, Any]]:
    """Each rank's trace of ``steps`` steps run back to back: every action its cost (us, one per micro-batch from
    ``cost[kind, stage]``), ``gap`` us of the runner's own time after each, and a ``wait`` us receive before each
    forward of a stage after the first; 1000 us between steps."""
    traces = []
    for rank in range(schedule.ranks):
        events, clock = [], 0.0
        for _ in range(steps):
            for action in schedule.actions(rank):
                kind = KIND[action.phase]
                if kind == "forward" and action.stage > 0 and wait:
                    events.append(complete_event("recv", action.microbatch, action.stage, clock, wait, rank,
                                                 channel="activation"))
                    clock += wait
                duration = cost[kind, action.stage][action.microbatch]
                events.append(complete_event(kind, action.microbatch, action.stage, clock, duration, rank))
                clock += duration + gap
            clock += 1000.0
        traces.append({"traceEvents": events, "otherData": {"clock_origin_unix_us": 0.0}})
    return traces


def _costs(stages: int) -> dict[tuple[str, int], list[float]]:
    """F 100 us (one slow micro-batch: the median ignores it), I 80, W 150 on stage s > 0; the first stage's I
    nothing and W the whole backward."""
    cost = {}
    for s in range(stages):
        cost["forward", s] = [100.0, 100.0, 900.0, 100.0]
        cost["input", s] = [80.0] * 4 if s else [1.0] * 4
        cost["weight", s] = [150.0] * 4 if s else [230.0] * 4
    return cost


def test_medians_overhead_and_wall_of_a_recorded_step() -> None:
    schedule = Schedule("zbv", 2, 4)
    step = traced_step(_recorded(schedule, _costs(4), gap=10.0, wait=5.0), balance=[2, 2, 2, 2])
    assert step.steps == 2 and step.split and step.balance == (2, 2, 2, 2)
    assert step.forward == pytest.approx((100e-6,) * 4)
    assert step.input_grad == pytest.approx((1e-6, 80e-6, 80e-6, 80e-6))
    assert step.weight_grad == pytest.approx((230e-6, 150e-6, 150e-6, 150e-6))
    assert step.overhead == pytest.approx(10e-6)  # the gap after each action; receive waits are not overhead
    rank_wall = [sum(_costs(4)[KIND[a.phase], a.stage][a.microbatch] + 10.0 for a in schedule.actions(r)) - 10.0
                 + 5.0 * sum(1 for a in schedule.actions(r) if a.phase is Phase.FORWARD and a.stage > 0)
                 for r in range(2)]
    assert step.wall == pytest.approx(max(rank_wall) * 1e-6)
    costs = step.costs()
    assert costs.overhead == pytest.approx(10e-6) and costs.cost("F", 1) == pytest.approx(110e-6)


def test_a_fused_backward_gives_b_and_halves() -> None:
    schedule = Schedule("1f1b", 2, 4)
    cost = {("forward", s): [100.0] * 4 for s in range(2)} | {("backward", s): [300.0] * 4 for s in range(2)}
    step = traced_step(_recorded(schedule, cost, steps=1), balance=[3, 1])
    assert not step.split and step.backward == pytest.approx((300e-6, 300e-6))
    costs = step.costs()
    assert costs.backward == pytest.approx((300e-6,) * 2) and costs.input_grad == pytest.approx((150e-6,) * 2)


def test_files_and_one_merged_trace_read_alike(tmp_path) -> None:
    traces = _recorded(Schedule("zb-h1", 2, 4), _costs(2))
    paths = []
    for rank, trace in enumerate(traces):
        paths.append(tmp_path / f"step.{rank}.json")
        paths[-1].write_text(json.dumps(trace))
    assert traced_step(paths, balance=[1, 1]) == traced_step(traces, balance=[1, 1])


@pytest.mark.parametrize("change, message", [
    ("balance", "does not match the 4 stages recorded"),
    ("partial", "holds part of a step"),
    ("empty", "holds no forward or backward spans"),
])
def test_a_trace_that_cannot_be_read_as_a_step_is_refused(change: str, message: str) -> None:
    traces = _recorded(Schedule("zbv", 2, 4), _costs(4))
    balance = [2, 2, 2, 2]
    if change == "balance":
        balance = [4, 4]
    elif change == "partial":
        traces[1]["traceEvents"].pop()
    else:
        traces = [{"traceEvents": []}]
    with pytest.raises(TraceError, match=message):
        traced_step(traces, balance=balance)


def _times(layers: int) -> LayerTimes:
    forward = [1e-6 * (k + 1) for k in range(layers)]
    return LayerTimes({4: forward}, {4: [3 * f for f in forward]}, {4: forward}, {4: [1000] * layers}, 3,
                      weight_grad={4: [2 * f for f in forward]})


def test_each_phase_is_read_off_as_the_recorded_sum_over_the_profiled_sum() -> None:
    step = traced_step(_recorded(Schedule("zbv", 2, 4), _costs(4)), balance=[1, 2, 2, 3])
    costs = Costs.from_layer_times(_times(8), 4)
    plan = Candidate("zbv", 4, (1, 2, 2, 3), "never", 2)
    profiled = costs.stage_costs([(0, 1), (1, 3), (3, 5), (5, 8)], 4)
    f, i, w, b = recorded_phases(costs, {plan: step})
    assert f == pytest.approx(sum(step.forward) / sum(profiled.forward))
    # I and W apart on the later stages; the first stage's I only replays, so there I + W counts for both.
    first = step.input_grad[0] + step.weight_grad[0], profiled.input_grad[0] + profiled.weight_grad[0]
    assert i == pytest.approx((sum(step.input_grad[1:]) + first[0]) / (sum(profiled.input_grad[1:]) + first[1]))
    assert w == pytest.approx((sum(step.weight_grad[1:]) + first[0]) / (sum(profiled.weight_grad[1:]) + first[1]))
    both = [step.input_grad[s] + step.weight_grad[s] for s in range(4)]
    assert b == pytest.approx(sum(both) / sum(profiled.input_grad[s] + profiled.weight_grad[s] for s in range(4)))
    with pytest.raises(ValueError, match=r"ran balance \[1, 2, 2, 3\]: record each plan as it is cut"):
        recorded_phases(costs, {Candidate("zbv", 4, (2, 2, 2, 2), "never", 2): step})


def test_too_few_step_times_read_the_overhead_off_the_recorded_steps_more_are_fitted() -> None:
    step = traced_step(_recorded(Schedule("zbv", 2, 4), _costs(4), gap=10.0), balance=[2, 2, 2, 2])
    costs = Costs.from_layer_times(_times(8), 4)
    plan = Candidate("zbv", 4, (2, 2, 2, 2), "never", 2)
    read = fit(costs, {plan: step.wall}, traced={plan: step})
    assert read.action_overhead == pytest.approx(10e-6) and read.contention == 1.0
    assert read.phases == pytest.approx(recorded_phases(costs, {plan: step}))
    plans = [plan, Candidate("1f1b", 4, (4, 4), "never"), Candidate("gpipe", 4, (3, 5), "never")]
    fitted = fit(costs, {c: step.wall * (1 + 0.1 * k) for k, c in enumerate(plans)}, traced={plan: step})
    assert fitted.phases == read.phases and fitted != read  # the constants come from the step times
    with pytest.raises(ValueError, match="needs measured step times"):
        fit(costs, {})


def test_auto_schedule_orders_by_the_time_model_read_off_recorded_steps() -> None:
    step = traced_step(_recorded(Schedule("zbv", 2, 4), _costs(4), gap=10.0), balance=[2, 2, 2, 2])
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    auto = auto_schedule(model, ranks=2, chunks=4, times=_times(8), measured=step, placement="v")
    assert auto.measured == (step,) and auto.costs.overhead == pytest.approx(10e-6)
    assert auto.model.phases[0] == pytest.approx(sum(step.forward) / sum(_times(8).forward[4]))
    assert lowered_step(auto.schedule, auto.costs) == pytest.approx(auto.step)
    assert sum(auto.costs.forward) == pytest.approx(sum(step.forward))  # the layers' forwards, as recorded
    again = auto_schedule(model, ranks=2, chunks=4, times=auto.times, placement="v", measured=[step])
    assert again.step == pytest.approx(auto.step) and again.balance == auto.balance
    with pytest.raises(ValueError, match=r"measured steps ran balances \[\[2, 2, 2, 2\]\], which do not cut the 4"):
        auto_schedule(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), ranks=2, chunks=4,
                      times=LayerTimes({4: [1e-6] * 4}, {4: [3e-6] * 4}, {4: [1e-6] * 4}, {4: [1000] * 4}, 3,
                                       weight_grad={4: [2e-6] * 4}),
                      measured=step, placement="v")


def test_cost_errors_name_the_action_whose_cost_was_wrong() -> None:
    """An order built with W of stage 2 at 100 us and F everywhere at 100 us, the runner's time at 10 us; the
    recorded step ran W of stage 2 at 150 us: that is named first, with its ratio."""
    step = traced_step(_recorded(Schedule("zbv", 2, 4), _costs(4), gap=10.0), balance=[2, 2, 2, 2])
    built = StageCosts.of([100e-6] * 4, [1e-6, 80e-6, 80e-6, 80e-6], [230e-6, 150e-6, 100e-6, 150e-6],
                          overhead=12e-6)
    errors = step.cost_errors(built)
    assert (errors[0].phase, errors[0].stage) == ("W", 2)
    assert errors[0].measured == pytest.approx(150e-6) and str(errors[0]).endswith("(1.50x)")
    assert str(errors[0]).startswith("W of stage 2: recorded 0.150 ms against 0.100 ms")
    assert (errors[1].phase, errors[1].stage) == ("overhead", -1) and "runner's time per action" in str(errors[1])
    assert all(e.measured == pytest.approx(e.predicted) for e in errors[2:])
    assert len(errors) == 3 * 4 + 1  # F, I and W of each stage (a split backward), and the runner's time
    with pytest.raises(ValueError, match="costs of 2 stages cannot be compared with a recorded step of 4"):
        step.cost_errors(StageCosts.of([1.0, 1.0], [1.0, 1.0], [1.0, 1.0]))
