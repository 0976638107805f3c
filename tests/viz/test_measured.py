"""Tests for pipe.viz.measured: recorded traces as timelines, steps, ranks and the matching plan."""
from __future__ import annotations

from typing import Any

import pytest

from pipe import trace
from pipe.trace import TraceError
from pipe.viz.measured import from_trace, schedule_like, step_starts


def test_a_recorded_pipe_becomes_a_timeline_per_stage(pipe_trace: dict[str, Any]) -> None:
    timeline = from_trace(pipe_trace)
    assert timeline.rows == ["stage 0", "stage 1"] and timeline.unit == "ms"
    for row in range(2):
        # 2 steps x 4 micro-batches; except_last recomputes 3 of 4.
        assert (timeline.count(row, "forward"), timeline.count(row, "backward"),
                timeline.count(row, "recompute")) == (8, 8, 6)
    assert timeline.origin == pytest.approx(min(e["ts"] for e in pipe_trace["traceEvents"] if e["ph"] == "X") / 1e3)
    assert 0.0 < timeline.bubble() < 1.0
    assert timeline.title.startswith("measured GPipe · 2 stages · 4 micro-batches · checkpoint=except_last · bubble")
    assert timeline.peak_inflight == [4, 4]  # GPipe: every micro-batch's forward before any backward


def test_steps_are_cut_at_the_first_forward(pipe_trace: dict[str, Any]) -> None:
    starts = step_starts(pipe_trace)
    assert len(starts) == 2 and starts[0] < starts[1]
    last = from_trace(pipe_trace, step=-1)
    assert "step 1 of 2" in last.title
    assert all(c.start >= starts[1] / 1e3 for c in last.cells)
    assert last.count(0, "forward") == 4 and last.count(1, "backward") == 4
    with pytest.raises(TraceError, match=r"step 2 is out of range: trace has 2 step\(s\) \(use --step between 0 and 1"):
        from_trace(pipe_trace, step=2)


def test_schedule_like_uses_the_mean_measured_durations(pipe_trace: dict[str, Any]) -> None:
    measured = from_trace(pipe_trace, step=0)
    planned = schedule_like(measured, pipe_trace)
    assert planned.unit == "ms" and planned.rows == measured.rows
    forwards = [c.duration for c in measured.cells if c.kind == "forward"]
    assert {round(c.duration, 9) for c in planned.cells if c.kind == "forward"} == {
        round(sum(forwards) / len(forwards), 9)}
    assert sorted(c.label for c in planned.cells if c.row == 0 and c.kind == "recompute") == ["R0", "R1", "R2"]


def test_empty_trace_is_refused() -> None:
    with pytest.raises(TraceError, match="has no spans to draw"):
        from_trace({"traceEvents": []})
    with pytest.raises(TraceError, match="--plan needs a trace with forward and backward"):
        forward_only = {"traceEvents": [trace.complete_event("forward", 0, 0, 0.0, 5.0, 0)]}
        schedule_like(from_trace(forward_only), forward_only)


def test_ranks_of_a_merged_trace_are_rows_and_their_stages_chunks() -> None:
    ranks = []
    for rank in range(2):
        events = [
            trace.complete_event("forward", 0, rank, 0.0 + 10 * rank, 10.0, rank),
            trace.complete_event("send", 0, rank, 10.0 + 10 * rank, 1.0, rank, peer=1 - rank),
            trace.complete_event("forward", 0, rank + 2, 40.0 + 10 * rank, 10.0, rank),  # second chunk
        ]
        ranks.append({"traceEvents": events, "otherData": {"clock_origin_unix_us": 0.0, "rank": rank,
                                                           "config": {"schedule": "interleaved"}}})
    timeline = from_trace(trace.merge(ranks))
    assert timeline.rows == ["rank 0", "rank 1"] and timeline.chunks == 2
    assert sorted((c.row, c.stage, c.chunk) for c in timeline.cells if c.kind == "forward") == [
        (0, 0, 0), (0, 2, 1), (1, 1, 0), (1, 3, 1)]
    assert timeline.count(0, "send") == 1
    assert timeline.title.startswith("measured interleaved 1F1B · 2 ranks")
