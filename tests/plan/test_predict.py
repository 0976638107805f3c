"""Predictions: step time from the schedule simulator, peak bytes from each rank's program."""
from __future__ import annotations

import pytest

from pipe.core.schedule import Schedule
from pipe.plan import Candidate, Costs, predict


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
    uniform_ = s.simulate(1.0, 2.0, 1.0, checkpoint_stop=2)
    lengths = {"F": 1.0, "B": 2.0, "R": 1.0}
    per_action = s.simulate(checkpoint_stop=2, durations=lambda a: lengths[a.phase.value])
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
