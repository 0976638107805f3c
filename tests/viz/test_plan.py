"""Tests for pipe.viz.planned: hand-computed tables, bubble formulas, titles and errors."""
from __future__ import annotations

import itertools

import pytest

from pipe.core.schedule import SCHEDULE_KINDS, Schedule
from pipe.viz.planned import plan
from pipe.viz.timeline import Timeline


def table(timeline: Timeline) -> list[list[tuple[str, float, float]]]:
    """Per row, (label, start, end) of every cell in time order."""
    rows: list[list[tuple[str, float, float]]] = [[] for _ in timeline.rows]
    for c in sorted(timeline.cells, key=lambda c: (c.row, c.start)):
        rows[c.row].append((c.label, c.start, c.end))
    return rows


def test_gpipe_two_stages_three_microbatches_by_hand() -> None:
    # forward = 1, backward = 2; stage 1 turns each micro-batch around, backward in reverse order.
    assert table(plan("gpipe", 2, 3)) == [
        [("F0", 0, 1), ("F1", 1, 2), ("F2", 2, 3), ("B2", 6, 8), ("B1", 8, 10), ("B0", 10, 12)],
        [("F0", 1, 2), ("F1", 2, 3), ("F2", 3, 4), ("B2", 4, 6), ("B1", 6, 8), ("B0", 8, 10)],
    ]


def test_1f1b_two_stages_three_microbatches_by_hand() -> None:
    # Stage 0 runs one warm-up forward, then alternates; stage 1 alternates from the start.
    assert table(plan("1f1b", 2, 3)) == [
        [("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("F2", 6, 7), ("B1", 7, 9), ("B2", 10, 12)],
        [("F0", 1, 2), ("B0", 2, 4), ("F1", 4, 5), ("B1", 5, 7), ("F2", 7, 8), ("B2", 8, 10)],
    ]


def test_except_last_recomputes_all_but_the_last_microbatch_by_hand() -> None:
    # Recompute (1 step) runs as soon as the stage is free, before its backward.
    assert table(plan("gpipe", 2, 2, checkpoint="except_last")) == [
        [("F0", 0, 1), ("F1", 1, 2), ("B1", 5, 7), ("R0", 7, 8), ("B0", 8, 10)],
        [("F0", 1, 2), ("F1", 2, 3), ("B1", 3, 5), ("R0", 5, 6), ("B0", 6, 8)],
    ]
    always = plan("gpipe", 2, 2, checkpoint="always")
    assert sorted(c.label for c in always.cells if c.kind == "recompute") == ["R0", "R0", "R1", "R1"]


@pytest.mark.parametrize("kind, stages, microbatches",
                         list(itertools.product(["gpipe", "1f1b"], range(1, 5), range(1, 9))))
def test_bubble_is_the_fill_drain_formula(kind: str, stages: int, microbatches: int) -> None:
    expected = (stages - 1) / (microbatches + stages - 1)
    assert plan(kind, stages, microbatches).bubble() == pytest.approx(expected)
    assert f"bubble {expected:.1%}" in plan(kind, stages, microbatches).title


@pytest.mark.parametrize("kind, virtual", [(k, v) for k in SCHEDULE_KINDS for v in (1, 2, 3)
                                           if k in ("interleaved", "looped-bfs") or v == 1])
def test_bubble_and_inflight_come_from_the_schedule(kind: str, virtual: int) -> None:
    timeline = plan(kind, 4, 8, virtual_stages=virtual, checkpoint="always")
    schedule = Schedule(kind, 4, 8, virtual)
    virtual = schedule.virtual_stages  # zbv: always 2
    # Chunks take 1/virtual of a stage's time; recompute defaults to the forward time.
    share = 1 / virtual
    assert timeline.bubble() == pytest.approx(schedule.bubble_fraction(share, 2 * share, share))
    assert timeline.peak_inflight == schedule.peak_inflight()
    assert timeline.chunks == virtual and timeline.unit == "step"
    assert {c.chunk for c in timeline.cells} == set(range(virtual))


def test_interleaving_shrinks_the_bubble() -> None:
    # Megatron: the bubble's time shrinks by the number of virtual stages.
    assert plan("interleaved", 4, 8, virtual_stages=2).bubble() < plan("1f1b", 4, 8).bubble()


def test_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    assert plan("1f1b", 4, 8).peak_inflight == [4, 3, 2, 1]
    assert plan("gpipe", 4, 8).peak_inflight == [8, 8, 8, 8]


def test_title_names_the_configuration() -> None:
    assert plan("interleaved", 2, 4, virtual_stages=2, checkpoint="always").title == (
        "interleaved 1F1B · 2 stages × 2 virtual · 4 micro-batches · checkpoint=always · bubble 8.6%"
    )
    assert plan("gpipe", 1, 1).title.startswith("GPipe · 1 stage · 1 micro-batch ·")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stages=0), r"ranks must be a positive integer \(got 0\)"),
        (dict(schedule="zigzag"), r"unknown schedule kind 'zigzag'"),
        (dict(checkpoint="sometimes"), r"checkpoint must be one of .* got 'sometimes'"),
        (dict(forward=0.0), r"forward duration must be a finite number > 0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_zero_bubble_plans_draw_input_and_weight_cells() -> None:
    # ZB-H1, 2 stages: stage 1 defers W0 by one pair; I and W take half the backward each.
    assert table(plan("zb-h1", 2, 2)) == [
        [("F0", 0, 1), ("F1", 1, 2), ("I0", 3, 4), ("W0", 4, 5), ("I1", 5, 6), ("W1", 6, 7)],
        [("F0", 1, 2), ("I0", 2, 3), ("F1", 3, 4), ("I1", 4, 5), ("W0", 5, 6), ("W1", 6, 7)],
    ]
    timeline = plan("zbv", 2, 4, checkpoint="always")
    assert {c.kind for c in timeline.cells} == {"forward", "input", "weight", "recompute"}
    assert timeline.kinds() == ["forward", "input", "weight", "recompute"]
    assert any("I: input gradient" in note for note in timeline.notes)
    assert any("chunks r and 2p-1-r" in note for note in timeline.notes)
    assert timeline.title.startswith("ZB-V · 2 stages × 2 virtual · 4 micro-batches")
    # Recompute happens once per cell, before I; W reuses the recomputed graph.
    assert timeline.count(0, "recompute") == timeline.count(0, "input") == timeline.count(0, "weight") == 8


def test_zero_bubble_shrinks_the_bubble() -> None:
    one_f_one_b, zb_h1, zbv = (plan(k, 4, 8).bubble() for k in ("1f1b", "zb-h1", "zbv"))
    assert zbv < zb_h1 < one_f_one_b
