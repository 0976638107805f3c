"""Tests for pipe.viz.text: the terminal timeline."""
from __future__ import annotations

from typing import Any

from pipe.viz.measured import from_trace
from pipe.viz.planned import schedule_timeline
from pipe.viz.text import nice_step, render_text


def test_plan_draws_like_the_schedule_docstring() -> None:
    lines = render_text([schedule_timeline("gpipe", 3, 4)]).splitlines()
    assert lines[0] == "GPipe · 3 stages · 4 micro-batches · checkpoint=never · bubble 33.3%"
    assert lines[2:5] == [
        "stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3--- B2--- B1--- B0---",
        "stage 1 | .  F0 F1 F2 F3 .  .  .  B3--- B2--- B1--- B0--- .  .",
        "stage 2 | .  .  F0 F1 F2 F3 B3--- B2--- B1--- B0--- .  .  .  .",
    ]
    assert lines[5].startswith("  steps | 0") and "15" in lines[5]
    assert "stage 0   busy  66.7%  F 4  B 4  peak in flight 4" in lines
    assert "bubble 33.3% of 3 rows × 18 steps" in lines
    assert lines[-1] == "F forward · B backward · . idle · numbers are micro-batches"


def test_later_chunks_are_lower_case() -> None:
    text = render_text([schedule_timeline("interleaved", 2, 2, virtual_stages=2)])
    assert "stage 0 | F0 F1 f0 f1 " in text and "lower case: later model chunks" in text


def test_measured_timeline_fits_the_width(pipe_trace: dict[str, Any]) -> None:
    timeline = from_trace(pipe_trace)
    text = render_text([timeline], width=80)
    rows = [line for line in text.splitlines() if line.startswith("stage ") and "|" in line]
    assert len(rows) == 2 and all(len(line) <= len("stage 0 | ") + 80 for line in rows)
    # Which letters fit in 80 columns depends on the measured durations (a short recompute may take no column on
    # a busy machine): the kinds are checked in the timeline, the drawing by a letter that always has room.
    assert {"forward", "backward", "recompute"} <= {c.kind for c in timeline.cells if c.row == 0}
    assert "F" in rows[0] or "B" in rows[0]
    assert "ms | 0" in text


def test_nice_step() -> None:
    assert [nice_step(span, 10) for span in (10, 33, 57, 2330, 0.9)] == [1, 5, 10, 500, 0.1]
