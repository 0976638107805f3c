"""Predictions: step time from the schedule simulator, peak bytes from each rank's program."""
from __future__ import annotations

import pytest

from pipe.core.program_time import phase_durations, time_schedule
from pipe.core.schedule import Schedule
from pipe.plan import Candidate, Costs, TimeModel, predict


def uniform(layers: int = 4, batch: int = 8) -> Costs:
    # 1 ms forward and 2 ms backward per sample and layer; 10 bytes kept, 4 bytes output per sample.
    return Costs.from_table(batch, [1e-3] * layers, [2e-3] * layers, [10] * layers, [4] * layers,
                            param_bytes=[100] * layers)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_uniform_stages_take_the_textbook_makespan(kind: str, chunks: int) -> None:
    costs = uniform()
    p = predict(costs, Candidate(kind, chunks, (2, 2), "never"))
    rows = 8 // chunks
    f, b = 2 * 1e-3 * rows, 2 * 2e-3 * rows  # one stage, one micro-batch
    assert p.step_time == pytest.approx((chunks + 2 - 1) * (f + b))


def test_recomputation_lengthens_the_step_by_the_recomputed_forwards() -> None:
    costs = uniform()
    never = predict(costs, Candidate("gpipe", 4, (2, 2), "never"))
    always = predict(costs, Candidate("gpipe", 4, (2, 2), "always"))
    assert always.step_time > never.step_time
    assert [t for t in always.timeline if t.action.phase.value == "R"]


def test_simulate_with_constant_durations_is_the_uniform_simulation() -> None:
    s = Schedule("interleaved", ranks=2, microbatches=4, virtual_stages=2)
    uniform_ = time_schedule(s, phase_durations(1.0, 2.0, 1.0), checkpoint_stop=2)
    lengths = {"F": 1.0, "B": 2.0, "R": 1.0}
    per_action = time_schedule(s, lambda a: lengths[a.phase.value], checkpoint_stop=2)
    assert per_action == uniform_


def test_peak_follows_the_micro_batches_in_flight() -> None:
    # From the table: a stage of 2 layers keeps (received input + 20 B/sample) per micro-batch; its
    # backward adds an output-sized gradient. GPipe holds every micro-batch, 1F1B ranks - rank of them.
    costs = uniform()
    rows = 2
    kept = [2 * 10 * rows, 4 * rows + 2 * 10 * rows]
    grad = 4 * rows
    static = 2.0 * 200
    gpipe = predict(costs, Candidate("gpipe", 4, (2, 2), "never"))
    assert gpipe.peaks == [static + 4 * kept[0] + grad, static + 4 * kept[1] + grad]
    one = predict(costs, Candidate("1f1b", 4, (2, 2), "never"))
    assert one.peaks == [static + 2 * kept[0] + grad, static + 1 * kept[1] + grad]


def test_checkpointing_keeps_only_the_boundaries() -> None:
    costs = uniform()
    never = predict(costs, Candidate("gpipe", 4, (2, 2), "never"))
    always = predict(costs, Candidate("gpipe", 4, (2, 2), "always"))
    assert all(a < n for a, n in zip(always.peaks, never.peaks))


def test_process_runner_counts_posted_receives_and_pending_sends() -> None:
    costs = uniform()
    c = Candidate("gpipe", 4, (2, 2), "never")
    assert all(p > t for p, t in zip(predict(costs, c, runner="processes").peaks, predict(costs, c).peaks))


def test_a_balance_that_does_not_cover_the_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="sum to 4"):
        predict(uniform(), Candidate("gpipe", 2, (1, 2), "never"))
    with pytest.raises(ValueError, match="chunks=3"):
        predict(uniform(), Candidate("gpipe", 3, (2, 2), "never"))


def test_the_time_model_fitted_on_four_plans_predicts_others() -> None:
    from pipe.plan import Link, TimeModel, fit

    costs = uniform()
    truth = TimeModel(link=Link(2e-4, 1e-9), action_overhead=1e-3, contention=1.3, message_overhead=5e-4)
    # Two stages send or receive one message per action: the interleaved plan's middle stages (two each)
    # tell the cost per message from the cost per action.
    fitted_on = [Candidate("gpipe", 2, (2, 2), "never"), Candidate("1f1b", 4, (2, 2), "always"),
                 Candidate("gpipe", 4, (1, 3), "except_last"), Candidate("interleaved", 2, (1, 1, 1, 1), "never", 2)]
    measured = {c: predict(costs, c, model=truth, runner="processes").step_time for c in fitted_on}
    model = fit(costs, measured, link=truth.link)
    assert model.action_overhead == pytest.approx(1e-3, rel=0.05)
    assert model.contention == pytest.approx(1.3, rel=0.02)
    assert model.message_overhead == pytest.approx(5e-4, rel=0.1)
    assert "0.500 ms per message" in model.describe()
    for other in (Candidate("1f1b", 4, (3, 1), "never"), Candidate("interleaved", 4, (1, 1, 1, 1), "never", 2),
                  Candidate("zb-h1", 4, (2, 2), "never"), Candidate("zbv", 4, (1, 1, 1, 1), "always", 2)):
        want = predict(costs, other, model=truth, runner="processes").step_time
        assert predict(costs, other, model=model, runner="processes").step_time == pytest.approx(want, rel=0.02)
    with pytest.raises(ValueError, match="positive seconds"):
        fit(costs, {fitted_on[0]: 0.0})


def test_messages_delay_the_receiver_by_latency_and_bytes() -> None:
    from pipe.plan import Link, TimeModel

    costs = uniform()
    c = Candidate("gpipe", 1, (2, 2), "never")
    bare = predict(costs, c, runner="processes").step_time
    slow = TimeModel(link=Link(latency=1e-3, per_byte=0.0))
    # One activation forward and one gradient backward cross the boundary: 2 messages on the critical path.
    assert predict(costs, c, runner="processes", model=slow).step_time == pytest.approx(bare + 2e-3)


def test_ranks_sharing_cores_compute_at_the_cores_speed() -> None:
    # 4 layers of 1 ms forward and 2 ms backward per sample, batch 8: 96 ms of compute in all.
    costs = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [100] * 4, [10] * 4)
    plan = Candidate("gpipe", 8, (2, 2), "never")
    alone = predict(costs, plan).step_time  # a core each: the two stages overlap
    assert predict(costs, plan, model=TimeModel(cores=2)).step_time == pytest.approx(alone)
    one_core = predict(costs, plan, model=TimeModel(cores=1)).step_time
    # One core for both ranks: while both compute, each at half speed; about the work, serialised.
    assert alone < 0.6 * 96e-3 and one_core == pytest.approx(96e-3, rel=0.05)
    # Replicas share the cores too: each of 2 pipelines (on half the batch) gets half of them.
    from pipe.plan.sharding import replica_costs

    replicated = predict(costs, Candidate("gpipe", 4, (2, 2), "never", dp_replicate=2), model=TimeModel(cores=2))
    half = predict(replica_costs(costs, 2), Candidate("gpipe", 4, (2, 2), "never"), model=TimeModel(cores=1))
    assert replicated.step_time == pytest.approx(half.step_time) and half.step_time == pytest.approx(48e-3, rel=0.05)
    with pytest.raises(ValueError, match="TimeModel.cores must be a number of cores > 0, or None, got 0"):
        TimeModel(cores=0)


def test_shared_stretch_is_the_mean_number_running_per_core() -> None:
    from pipe.core.action import Action, Phase, TimedAction
    from pipe.plan.timing import shared_stretch

    a, b = Action(Phase.FORWARD, 0, 0), Action(Phase.FORWARD, 0, 1)
    # a runs 0-4, b runs 2-4 beside it: on 1 core, a shares half its span (mean 1.5), b all of it (2).
    stretch = shared_stretch([TimedAction(a, 0, 0.0, 4.0), TimedAction(b, 1, 2.0, 4.0)], cores=1)
    assert stretch == {a: pytest.approx(1.5), b: pytest.approx(2.0)}
    assert shared_stretch([TimedAction(a, 0, 0.0, 4.0), TimedAction(b, 1, 2.0, 4.0)], cores=2) == {a: 1.0, b: 1.0}
