"""Measured timelines: a recorded trace (:mod:`pipe.trace`) laid out like a plan.

Rows are the stages of the thread pipeline (one ``pid``), or the ranks of a
multi-process one (several ``pid``s; a rank's virtual stages share its row as
chunks). Times are milliseconds from the first span shown. A trace of several
training steps can be cut into steps: a step begins at each forward of
micro-batch 0 on the first row.
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional

from pipe.core.schedule import Schedule
from pipe.trace import TraceError
from pipe.core.deprecation import moved
from pipe.viz.planned import SCHEDULE_NAMES, lay_out
from pipe.viz.timeline import Span, Timeline

__all__: list[str] = []


def _spans(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _by_rank(spans: list[dict[str, Any]]) -> bool:
    """Whether rows are ranks (several processes) rather than stages (threads of one)."""
    return len({e["pid"] for e in spans}) > 1


def _row_key(event: Mapping[str, Any], by_rank: bool) -> tuple[int, int]:
    return (event["pid"], 0) if by_rank else (event["pid"], event["tid"])


def step_starts(trace: Mapping[str, Any]) -> list[float]:
    """Start times (us) of the steps: forwards of micro-batch 0 on the first row."""
    spans = _spans(trace)
    if not spans:
        return []
    by_rank = _by_rank(spans)
    first = min(_row_key(e, by_rank) for e in spans)
    return sorted(
        e["ts"] for e in spans
        if e.get("cat") == "forward" and e.get("args", {}).get("microbatch") == 0 and _row_key(e, by_rank) == first
    )


def from_trace(trace: Mapping[str, Any], step: Optional[int] = None, source: str = "trace") -> Timeline:
    """The measured timeline of a trace (all of it, or one step).

    Args:
        trace: a Chrome trace-event object, as :func:`pipe.trace.load` returns.
        step: which step to show (0-based; negative counts from the end), or
            None for the whole trace.
        source: how to name the trace in errors.

    Raises:
        TraceError: the trace has no spans, or ``step`` is out of range.
    """
    spans = _spans(trace)
    if not spans:
        raise TraceError(
            f"{source} has no spans to draw; record a training step inside pipe.trace.record()"
        )
    starts = step_starts(trace)
    steps = max(1, len(starts))
    which = ""
    if step is not None:
        if not -steps <= step < steps or not starts:
            raise TraceError(
                f"step {step} is out of range: {source} has {len(starts)} step(s) "
                f"(use --step between 0 and {len(starts) - 1}, or leave it out to draw all)"
            )
        index = step % steps
        low = starts[index]
        high = starts[index + 1] if index + 1 < len(starts) else float("inf")
        spans = [e for e in spans if low <= e["ts"] < high]
        which = f" · step {index} of {steps}"

    by_rank = _by_rank(spans)
    keys = sorted({_row_key(e, by_rank) for e in spans})
    row_of = {key: row for row, key in enumerate(keys)}
    rows = [f"rank {pid}" if by_rank else f"stage {tid}" for pid, tid in keys]
    stages_of: dict[int, list[int]] = {}
    for e in spans:
        if by_rank:
            stages_of.setdefault(e["pid"], [])
            if e["tid"] not in stages_of[e["pid"]]:
                stages_of[e["pid"]].append(e["tid"])
    cells = []
    for e in spans:
        args = e.get("args", {})
        chunk = sorted(stages_of[e["pid"]]).index(e["tid"]) if by_rank else 0
        cells.append(Span(
            row=row_of[_row_key(e, by_rank)],
            kind=str(e.get("cat", args.get("phase", "other"))),
            start=e["ts"] / 1000.0,
            end=(e["ts"] + e["dur"]) / 1000.0,
            microbatch=args.get("microbatch"),
            stage=args.get("stage", e["tid"]),
            chunk=chunk,
            segment=int(args.get("segment", 0)),
        ))
    config = dict(trace.get("otherData", {}).get("config", {}))
    microbatches = len({c.microbatch for c in cells if c.kind == "forward" and c.microbatch is not None})
    timeline = Timeline(
        title="",
        rows=rows,
        cells=cells,
        unit="ms",
        chunks=max(1, max((c.chunk for c in cells), default=0) + 1),
        notes=[
            "measured wall time of each span; busy = forward, backward or recompute "
            "(transfers and waits are not), overlaps counted once",
        ],
    )
    timeline.peak_inflight = timeline.measured_inflight()
    name = SCHEDULE_NAMES.get(str(config.get("schedule", "")), str(config.get("schedule", "Pipe")))
    parts = [f"measured {name}", f"{len(rows)} {'ranks' if by_rank else 'stages'}",
             f"{microbatches} micro-batches{which}"]
    if "checkpoint" in config:
        parts.append(f"checkpoint={config['checkpoint']}")
    timeline.title = " · ".join(parts) + f" · bubble {timeline.bubble():.1%}"
    return timeline


def schedule_like(measured: Timeline, trace: Mapping[str, Any]) -> Timeline:
    """The plan of the measured configuration, with the mean measured durations (ms).

    Shows what the same run would look like if every span took its mean time
    and transfers were free, on the same time axis as the measurement.

    Raises:
        TraceError: the trace holds no forward and backward to time.
    """
    config = trace.get("otherData", {}).get("config", {})
    forwards, backwards, recomputes = (measured.durations(k) for k in ("forward", "backward", "recompute"))
    inputs, weights = measured.durations("input"), measured.durations("weight")
    split = (statistics.fmean(inputs), statistics.fmean(weights)) if inputs and weights else None
    if split is not None and not backwards:  # a zero-bubble schedule: backward = I + W
        backwards = [split[0] + split[1]]
    if not forwards or not backwards:
        raise TraceError("--plan needs a trace with forward and backward spans (a training step, not eval)")
    microbatches = sorted({c.microbatch for c in measured.cells if c.kind == "forward" and c.microbatch is not None})
    recomputed = {c.microbatch for c in measured.cells if c.kind == "recompute"}
    kind = str(config.get("schedule", "gpipe"))
    schedule = Schedule(
        kind if kind in SCHEDULE_NAMES else "gpipe",
        ranks=len(measured.rows),
        microbatches=len(microbatches),
        virtual_stages=measured.chunks,
    )
    forward, backward = statistics.fmean(forwards), statistics.fmean(backwards)
    recompute = statistics.fmean(recomputes) if recomputes else 0.0
    timeline = lay_out(schedule, forward, backward, recompute, len(recomputed), unit="ms", split=split)
    timeline.rows = list(measured.rows)
    timeline.title = (f"plan for the same configuration, mean measured durations · "
                      f"bubble {timeline.bubble():.1%}")
    timeline.notes = [
        f"mean forward {forward:.2f} ms, backward {backward:.2f} ms"
        + (f" (I {split[0]:.2f} + W {split[1]:.2f})" if split is not None else "")
        + (f", recompute {recompute:.2f} ms" if recomputes else "") + "; transfers free"
    ]
    return timeline


__getattr__ = moved(__name__, __name__, {"plan_like": "schedule_like"})  # the old name, one release
