"""Tests for pipe.viz.timeline: busy time, utilisation, bubble, in-flight counts, trace export."""
from __future__ import annotations

import pytest

from pipe import trace
from pipe.viz.timeline import Span, Timeline


def make() -> Timeline:
    return Timeline(
        title="t",
        rows=["stage 0", "stage 1"],
        cells=[
            Span(0, "forward", 0.0, 2.0, 0, 0),
            Span(0, "forward", 1.0, 3.0, 1, 0),  # overlaps the first: counted once
            Span(0, "backward", 6.0, 8.0, 1, 0),
            Span(0, "backward", 8.0, 10.0, 0, 0),
            Span(1, "recompute", 4.0, 5.0, 0, 1),
            Span(1, "recv", 5.0, 9.0, 1, 1),  # a transfer (or a wait): drawn, not busy
        ],
    )


def test_busy_utilisation_and_bubble() -> None:
    t = make()
    assert (t.origin, t.end, t.makespan) == (0.0, 10.0, 10.0)
    assert t.busy(0) == 7.0 and t.busy(1) == 1.0
    assert t.utilisation() == [0.7, 0.1]
    assert t.bubble() == pytest.approx(0.6)
    assert t.kinds() == ["forward", "backward", "recompute", "recv"]
    assert t.count(0, "forward") == 2


def test_measured_inflight_counts_forwards_not_yet_backwarded() -> None:
    assert make().measured_inflight() == [2, 0]


def test_labels() -> None:
    assert Span(0, "forward", 0, 1, 3).label == "F3"
    assert Span(0, "recv", 0, 1, 2).label == "V2"
    assert Span(0, "backward", 0, 1).label == "B"


def test_to_trace_is_a_valid_chrome_trace() -> None:
    data = make().to_trace()
    trace.validate(data)
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in spans][:2] == [("F0", 0.0, 2000.0, 0),
                                                                            ("F1", 1000.0, 2000.0, 0)]
    assert data["otherData"]["bubble"] == pytest.approx(0.6)


def test_a_backward_in_segments_counts_once_and_sums() -> None:
    t = Timeline(title="t", rows=["stage 0"], cells=[
        Span(0, "forward", 0.0, 1.0, 0, 0),
        Span(0, "backward", 2.0, 3.0, 0, 0),  # interleaved with other work: two segments
        Span(0, "backward", 4.0, 4.5, 0, 0, segment=1),
        Span(0, "forward", 7.0, 8.0, 0, 0),  # the next step
        Span(0, "backward", 9.0, 9.5, 0, 0),
    ])
    assert t.count(0, "backward") == 2 and t.count(0, "forward") == 2
    assert t.durations("backward") == [1.5, 0.5]
    assert t.measured_inflight() == [1]


def test_one_pass_statistics_equal_the_per_row_ones() -> None:
    # by_row/busy_per_row/counts serve large plans in one pass; they must say what busy/count say.
    from pipe.viz.planned import schedule_timeline

    timeline = schedule_timeline("interleaved", 3, 6, virtual_stages=2, checkpoint="except_last")
    rows = range(len(timeline.rows))
    assert timeline.busy_per_row() == [timeline.busy(row) for row in rows]
    assert timeline.counts() == [{k: timeline.count(row, k) for k in timeline.kinds()} for row in rows]
    assert [len(cells) for cells in timeline.by_row()] == [sum(c.row == row for c in timeline.cells) for row in rows]
