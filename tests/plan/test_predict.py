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


def test_calibration_fits_the_runner_overhead_to_a_measured_step() -> None:
    from pipe.plan import calibrate

    costs = uniform()
    reference = Candidate("gpipe", 4, (2, 2), "never")
    bare = predict(costs, reference).step_time
    # A runner that spends 1 ms per action: 4 + 2 - 1 = 5 forward and 5 backward slots on the critical path.
    overhead = calibrate(costs, reference, bare + 10 * 1e-3)
    assert overhead == pytest.approx(1e-3)
    assert predict(costs, reference).step_time == pytest.approx(bare + 10e-3)
    with pytest.raises(ValueError, match="profile the layers again"):
        calibrate(costs, reference, bare / 2)
