"""Orders built from per-stage costs (pipe.core.cost_order): valid for random costs and memory limits, within the
limit, never slower in simulation than the best fixed schedule under the same costs, saved and reloaded."""
from __future__ import annotations

import io
import random

import pytest

from pipe.core.cost_order import POST_CHOICES, candidate_orders, choose_posts, peak_held, schedule_from_costs
from pipe.core.stage_costs import StageCosts, busy_bound, lowered_step
from pipe.core.options import checkpoint_stop
from pipe.core.schedule import Schedule
from pipe.core.schedule_table import TableSchedule


def _random_costs(rng: random.Random, stages: int) -> StageCosts:
    forward = [rng.uniform(0.3, 2.0) for _ in range(stages)]
    input_grad = [rng.uniform(0.1, 2.0) for _ in range(stages)]
    weight_grad = [rng.uniform(0.1, 3.0) for _ in range(stages)]
    if rng.random() < 0.5:
        input_grad[0] = 0.0  # the first stage's input needs no gradient
    backward = [(i + w) * rng.uniform(0.8, 1.0) for i, w in zip(input_grad, weight_grad)] if rng.random() < 0.3 \
        else None
    activation = [rng.choice([1.0, 2.0, 3.0]) for _ in range(stages)] if rng.random() < 0.3 else 1.0
    return StageCosts.of(forward, input_grad, weight_grad, backward=backward, activation=activation,
                         transfer=[rng.uniform(0.0, 0.4) for _ in range(stages - 1)])


@pytest.mark.parametrize("seed", range(60))
def test_random_costs_give_a_valid_order_within_the_limit_no_slower_than_any_fixed_schedule(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([1, 2, 3, 4])
    per_rank = rng.choice([1, 2])
    microbatches = rng.choice([1, 2, 3, 4, 6, 8])
    checkpoint = rng.choice(["never", "never", "always", "except_last"])
    costs = _random_costs(rng, ranks * per_rank)
    share = max(sum(costs.activation[s] for s in range(costs.stages) if s % ranks == r) for r in range(ranks))
    limit = None if rng.random() < 0.4 else rng.uniform(share, ranks * share * 1.5)
    table = schedule_from_costs(costs, ranks=ranks, microbatches=microbatches, memory_limit=limit,
                                checkpoint=checkpoint)
    table.validate()
    assert (table.ranks, table.microbatches, table.stages) == (ranks, microbatches, costs.stages)
    found = candidate_orders(costs, ranks=ranks, microbatches=microbatches, memory_limit=limit, checkpoint=checkpoint)
    chosen_limit = next(c.limit for c in found if c.schedule.placement == table.placement)
    assert max(peak_held(table, costs.activation)) <= chosen_limit + 1e-9
    stop = checkpoint_stop(checkpoint, microbatches)
    step = lowered_step(table, costs, stop)  # receives posted where the table says
    fixed = [c for c in found if not c.name.startswith("auto") and c.fits]
    for candidate in fixed:  # judged by the same simulator, under the same costs and limit, posts one ahead
        assert step <= lowered_step(candidate.schedule, costs, stop) + 1e-9, (candidate.name, candidate.step, step)
    for candidate in found:  # no order beats the busiest rank's own work
        assert candidate.step >= busy_bound(costs, candidate.schedule.placement, microbatches, stop) - 1e-9
    for candidate in found:  # every greedy order is a valid table within its limit
        if candidate.name.startswith("auto"):
            candidate.schedule.validate()
            assert candidate.fits, candidate.name


def test_uneven_costs_beat_every_fixed_schedule() -> None:
    """W 2.3x an I, the first stage's I empty, the last stage carrying a head: the fixed orders wait, auto less."""
    costs = StageCosts.of([1.0, 1.0, 1.0, 1.6], [0.0, 1.0, 1.0, 1.3], [2.3, 2.3, 2.3, 3.0], transfer=0.1)
    found = candidate_orders(costs, ranks=2, microbatches=8)
    fixed = min(c.step for c in found if not c.name.startswith("auto") and c.fits)
    table = schedule_from_costs(costs, ranks=2, microbatches=8)
    assert table.name == "auto"
    assert lowered_step(table, costs) < fixed * 0.99


def test_uniform_costs_match_the_zero_bubble_schedules() -> None:
    costs = StageCosts.of([1.0, 1.0], [1.0, 1.0], [1.0, 1.0])
    table = schedule_from_costs(costs, ranks=2, microbatches=6)
    zb = Schedule("zb-h1", 2, 6)
    assert lowered_step(table, costs) == lowered_step(zb, costs)


def test_the_order_is_saved_reloaded_and_drawn(tmp_path) -> None:
    from pipe.viz.cli import main

    costs = StageCosts.of([1.0, 1.2, 0.9, 1.5], [0.0, 0.8, 0.9, 1.2], [1.9, 2.0, 2.1, 2.6], transfer=0.05)
    table = schedule_from_costs(costs, ranks=2, microbatches=4, placement="v")
    assert table.placement == (0, 1, 1, 0)
    path = tmp_path / "auto.csv"
    path.write_text(table.to_csv())
    again = TableSchedule.from_csv(path)
    assert again.programs == table.programs and again.placement == table.placement
    assert lowered_step(again, costs) == lowered_step(table, costs)
    out = tmp_path / "auto.svg"
    assert main(["plan", "--table", str(path), "--output", str(out)]) == 0
    assert out.read_text().startswith("<svg") and "auto" in out.read_text()


def test_an_order_is_drawn_with_its_own_costs(tmp_path, capsys) -> None:
    import dataclasses
    import json

    from pipe.viz.cli import main
    from pipe.viz.planned import lay_out

    costs = StageCosts.of([1.0, 1.2, 0.9, 1.5], [0.0, 0.8, 0.9, 1.2], [1.9, 2.0, 2.1, 2.6], transfer=0.05,
                          overhead=0.01)
    table = schedule_from_costs(costs, ranks=2, microbatches=4, placement="v")
    timeline = lay_out(table, 1.0, 2.0, 1.0, 0, costs=costs)  # what the picture shows is the simulated step
    assert max(c.end for c in timeline.cells) == pytest.approx(lowered_step(table, costs))
    assert "F 1/1.2/0.9/1.5" in timeline.notes[0] and "the runner 0.01 per action" in timeline.notes[0]
    (tmp_path / "auto.csv").write_text(table.to_csv())
    (tmp_path / "costs.json").write_text(json.dumps(dataclasses.asdict(costs)))
    out = tmp_path / "auto.txt"
    assert main(["plan", "--table", str(tmp_path / "auto.csv"), "--costs", str(tmp_path / "costs.json"),
                 "--output", str(out)]) == 0
    assert "F 1/1.2/0.9/1.5" in out.read_text()
    (tmp_path / "bad.json").write_text(json.dumps({"forward": [1.0, 1.0]}))
    for argv, message in (
            (["--table", str(tmp_path / "auto.csv"), "--costs", str(tmp_path / "bad.json")],
             "missing 2 required positional arguments"),
            (["--costs", str(tmp_path / "costs.json")], "--costs gives each stage of a table its own costs"),
            (["--table", str(tmp_path / "auto.csv"), "--costs", str(tmp_path / "nothing.json")], "cannot read it")):
        with pytest.raises(SystemExit):
            main(["plan", *argv, "--output", str(out)])
        assert message in capsys.readouterr().err
    two = StageCosts.of([1.0, 1.0], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="costs of 2 stages for a schedule of 4"):
        lay_out(table, 1.0, 2.0, 1.0, 0, costs=two)


def test_in_flight_bounds_each_rank() -> None:
    costs = StageCosts.of([1.0] * 4, [1.0] * 4, [2.0] * 4)
    for in_flight in (1, 2, 3):
        table = schedule_from_costs(costs, ranks=4, microbatches=8, in_flight=in_flight)
        assert max(table.peak_inflight()) <= in_flight


@pytest.mark.parametrize("call, message", [
    (lambda: StageCosts.of([1.0, 1.0], [1.0], [1.0, 1.0]), r"input_grad needs 2 entries"),
    (lambda: StageCosts.of([1.0, float("nan")], [1.0, 1.0], [1.0, 1.0]), r"forward\[1\] = nan"),
    (lambda: StageCosts.of([1.0], [1.0], [1.0], activation=0), r"activation\[0\] = 0.*> 0"),
    (lambda: schedule_from_costs(StageCosts.of([1.0] * 3, [1.0] * 3, [1.0] * 3), ranks=2, microbatches=4),
     r"3 stages do not divide among 2 ranks"),
    (lambda: schedule_from_costs(StageCosts.of([1.0] * 2, [1.0] * 2, [1.0] * 2), ranks=2, microbatches=4,
                                 placement="v"), r"needs 4 stages for 2 ranks"),
    (lambda: schedule_from_costs(StageCosts.of([1.0] * 2, [1.0] * 2, [1.0] * 2), ranks=2, microbatches=4,
                                 in_flight=0.5), r"no order .* holds at most 0.5 per rank.*raise the limit to 1"),
    (lambda: schedule_from_costs(StageCosts.of([1.0] * 2, [1.0] * 2, [1.0] * 2), ranks=2, microbatches=4,
                                 checkpoint="sometimes"), r"checkpoint must be one of"),
    (lambda: schedule_from_costs([1.0, 1.0], ranks=2, microbatches=4), r"costs must be a StageCosts"),
])
def test_bad_input_is_refused_with_the_fix(call, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_the_runners_overhead_counts_per_action() -> None:
    """A split backward pays the overhead twice (I and W), a B once; a recompute none."""
    costs = StageCosts.of([1.0], [1.0], [2.0], overhead=0.5)
    assert [costs.cost(p, 0) for p in "FIWBR"] == [1.5, 1.5, 2.5, 3.5, 1.0]
    assert busy_bound(costs, [0], 2) == 2 * (1.5 + 3.5)


def test_posts_are_chosen_where_messages_are_slow_and_kept_with_the_table() -> None:
    """Transfers longer than an action: a rank that posts its receives one action ahead waits for bytes that
    could have moved during the action before; the search posts further ahead, and is faster by it."""
    costs = StageCosts.of([1.0] * 4, [1.0] * 4, [1.4] * 4, transfer=1.5)
    table = schedule_from_costs(costs, ranks=4, microbatches=8)
    assert max(table.posts) > 1, table.posts
    one_ahead = lowered_step(table.with_posts([1] * 4), costs)
    assert lowered_step(table, costs) < one_ahead * 0.98
    every = table.with_posts([len(table.programs[r]) for r in range(4)])  # every receive posted at the start
    assert lowered_step(table, costs) >= lowered_step(every, costs) - 1e-9  # a message moves once sent, at best
    again = TableSchedule.from_csv(io.StringIO(table.to_csv()))
    assert again.posts == table.posts and again.programs == table.programs
    same, step = choose_posts(table.with_posts([1] * 4), costs)
    assert step == pytest.approx(lowered_step(table, costs)) and max(same.posts) <= max(POST_CHOICES)


def test_free_messages_keep_every_rank_posting_one_ahead() -> None:
    costs = StageCosts.of([1.0, 1.3], [0.5, 1.0], [1.5, 2.0])
    table = schedule_from_costs(costs, ranks=2, microbatches=4)
    assert table.post_ahead(0) == table.post_ahead(1) == 1 and "post_ahead" not in table.to_csv()
    assert choose_posts(table.with_posts([3, 2]), costs)[0].posts == (1, 1)  # as fast: the fewest ahead
