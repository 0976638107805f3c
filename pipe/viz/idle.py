"""Idle time: where every idle millisecond of a timeline went, each interval with its cause.

A timeline (a recorded trace, :mod:`pipe.trace`, or a predicted plan) shows
boxes; this module names the gaps between them. On each row (a stage of the
thread pipeline, or a rank), the step's wall time is cut into busy time
(compute: forward, backward, recompute; transfer: copy, send, recv) and idle
intervals, and each idle interval gets a cause from the schedule's data
dependencies (the simulator's rule, :func:`pipe.core.program_time.time_schedule`: a forward
needs the forward of the stage before, a backward the backward of the stage
after, the last stage's backward its own forward):

* **bubble**: waiting for the named action (``F3@0``) for as long as the
  schedule itself makes this row wait there (the plan of the same schedule
  with the mean measured durations), and the drain after a row's last action;
* **wait**: waiting for the named action beyond that (a slow or late upstream
  stage, a transfer that held it);
* **overhead**: the awaited action had already ended (or there was none):
  runtime work between actions that no span covers.

A receive of the process runner (``recv`` span) blocks until the sender's
action ends: that part of it is waiting for that action (bubble or wait),
the rest is transfer.

The busy time and the idle intervals tile the step window exactly, so the
attributed share of every row is 100% by construction::

    stage 1 |  F0  ....  F1  B1 ....  B0 |
                   ^ wait for F1@0 (bubble 0.4 ms, wait 0.1 ms)

:mod:`pipe.plan.explain` applies it to recorded traces and predicted plans;
``pipe-viz trace --explain`` prints it. It lives with the timelines it reads
(observation), below the planner, so both may use it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from pipe.core.program_time import time_schedule
from pipe.core.action import Action, Phase
from pipe.core.schedule import SCHEDULE_KINDS, Schedule
from pipe.viz.timeline import COMPUTE, Span, Timeline

__all__: list[str] = []

#: Idle causes, in table order.
CATEGORIES: tuple[str, ...] = ("bubble", "wait", "overhead")

_PHASE = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD, "recompute": Phase.BACKWARD,
          "input": Phase.INPUT, "weight": Phase.WEIGHT}


@dataclass(frozen=True)
class Idle:
    """One idle interval of one row, with its cause.

    Attributes:
        row: the row's index; ``start``/``end`` in the timeline's unit.
        category: one of :data:`CATEGORIES`.
        before: the span that ended the idle interval (``B3@1``), or None at the end of the step.
        waiting_for: the awaited action (``F3@0``), or None.
        waiting_on: the row that ran it (``stage 0``/``rank 0``), or None.
    """

    row: int
    start: float
    end: float
    category: str
    before: Optional[str] = None
    waiting_for: Optional[str] = None
    waiting_on: Optional[str] = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    def describe(self, rows: list[str], unit: str) -> str:
        amount = f"{self.duration:.3g} {unit}"
        if self.waiting_for is not None:
            what = "waiting for" if self.category != "overhead" else "after the arrival of"
            text = f"{rows[self.row]} idled {amount} {what} {self.waiting_for} from {self.waiting_on}"
        elif self.before is None:
            text = f"{rows[self.row]} idled {amount} after its last action (drain)"
        else:
            text = f"{rows[self.row]} idled {amount} before {self.before} (nothing to wait for)"
        return f"{text} [{self.category}]"


@dataclass
class Explanation:
    """A step's wall time, row by row: compute, transfer and named idle intervals.

    Attributes:
        rows, unit: as the timeline's.
        start, end: the step window (first start to last end over all rows).
        compute, transfer: per row, busy time (union of spans, overlaps once).
        idle: every idle interval with its cause.
    """

    rows: list[str]
    unit: str
    start: float
    end: float
    compute: list[float]
    transfer: list[float]
    idle: list[Idle] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return self.end - self.start

    def idle_by(self, row: int, category: Optional[str] = None) -> float:
        return sum(i.duration for i in self.idle if i.row == row and (category is None or i.category == category))

    def attributed(self, row: int) -> float:
        """The share of ``row``'s wall time that is compute, transfer or named idle time."""
        if self.wall <= 0:
            return 1.0
        return (self.compute[row] + self.transfer[row] + self.idle_by(row)) / self.wall

    def summary(self) -> list[dict[str, Any]]:
        """One dict per row: wall, compute, transfer, each idle category, attributed share."""
        return [{"row": name, "wall": self.wall, "compute": self.compute[r], "transfer": self.transfer[r],
                 **{c: self.idle_by(r, c) for c in CATEGORIES}, "attributed": self.attributed(r)}
                for r, name in enumerate(self.rows)]

    def table(self, top: int = 5) -> str:
        """A table per row, then the longest idle intervals in words."""
        u = self.unit
        head = f"{'row':<10}{'wall':>10}{'compute':>10}{'transfer':>10}" + "".join(f"{c:>10}" for c in CATEGORIES)
        lines = [f"idle time explained ({u}); bubble = the schedule's own wait, wait = beyond it, "
                 f"overhead = nothing left to wait for", head + f"{'explained':>10}"]
        for s in self.summary():
            lines.append(f"{s['row']:<10}{s['wall']:>10.3f}{s['compute']:>10.3f}{s['transfer']:>10.3f}"
                         + "".join(f"{s[c]:>10.3f}" for c in CATEGORIES) + f"{s['attributed']:>10.1%}")
        longest = sorted(self.idle, key=lambda i: -i.duration)[:top]
        if longest:
            lines.append("longest idle intervals:")
            lines += [f"  {i.describe(self.rows, u)}" for i in longest]
        return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _expected_idle(timeline: Timeline, stage_rows: dict[int, int], kind: str) -> dict[Action, float]:
    """Idle time before each action in the plan of the same schedule with the mean measured durations."""
    stages = len(stage_rows)
    ranks = len({row for row in stage_rows.values()})
    microbatches = 1 + max((c.microbatch for c in timeline.cells if c.kind in COMPUTE and c.microbatch is not None),
                           default=0)
    if kind not in SCHEDULE_KINDS or stages % ranks:
        kind = "gpipe"
    try:
        schedule = Schedule(kind, ranks=ranks, microbatches=microbatches, virtual_stages=stages // ranks)
    except ValueError:
        return {}
    means: dict[tuple[str, int], float] = {}
    for phase in COMPUTE:
        per_stage: dict[int, list[float]] = {}
        for c in timeline.cells:
            if c.kind == phase and c.stage is not None:
                per_stage.setdefault(c.stage, []).append(c.duration)
        for stage, values in per_stage.items():
            means[(phase, stage)] = statistics.fmean(values)
    recomputed = {c.microbatch for c in timeline.cells if c.kind == "recompute" and c.microbatch is not None}
    stop = max(recomputed) + 1 if recomputed else 0
    name = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.RECOMPUTE: "recompute",
            Phase.INPUT: "input", Phase.WEIGHT: "weight"}

    def duration(action: Action) -> float:
        return means.get((name[action.phase], action.stage), 0.0) or (
            1e-9 if action.phase is not Phase.RECOMPUTE else 0.0)

    expected: dict[Action, float] = {}
    free = [0.0] * ranks
    for timed in sorted(time_schedule(schedule, duration, checkpoint_stop=stop), key=lambda t: t.start):
        if timed.action.phase is not Phase.RECOMPUTE:
            expected[timed.action] = expected.get(timed.action, 0.0) + max(0.0, timed.start - free[timed.rank])
        else:  # a recompute runs as soon as the rank is free; the backward (or I) after it waits
            after = Phase.INPUT if schedule.splits_backward else Phase.BACKWARD
            expected[Action(after, timed.action.microbatch, timed.action.stage)] = max(
                0.0, timed.start - free[timed.rank])
        free[timed.rank] = timed.end
    return expected


def explain_timeline(timeline: Timeline, schedule: str = "gpipe", bubble_only: bool = False) -> Explanation:
    """Attributes every idle interval of every row of ``timeline``.

    Args:
        timeline: measured (:func:`pipe.viz.measured.from_trace`) or planned.
        schedule: the schedule kind that ran (for the share that is the schedule's own bubble).
        bubble_only: every wait is the schedule's own (for a plan, which has no delays).
    """
    cells = sorted(timeline.cells, key=lambda c: (c.start, c.end))
    if not cells:
        raise ValueError("the timeline has no spans to explain; record a training step inside pipe.trace.record()")
    start, end = timeline.origin, timeline.end
    stage_rows = {c.stage: c.row for c in cells if c.kind in COMPUTE and c.stage is not None}
    stages = max(stage_rows, default=0) + 1
    rule = Schedule("gpipe", ranks=stages, microbatches=1)  # only its dependency rule is used
    # When each action ended (a backward in segments ends with its last one).
    ended: dict[Action, float] = {}
    for c in cells:
        if c.kind in ("forward", "backward", "input", "weight") and c.microbatch is not None and c.stage is not None:
            action = Action(_PHASE[c.kind], c.microbatch, c.stage)
            ended[action] = max(ended.get(action, c.end), c.end)
    expected = {} if bubble_only else _expected_idle(timeline, stage_rows, schedule)
    rows = list(timeline.rows)
    explanation = Explanation(rows, timeline.unit, start, end, [0.0] * len(rows), [0.0] * len(rows))
    for row in range(len(rows)):
        mine, consumers = _split_receives([c for c in cells if c.row == row], ended, rule)
        explanation.compute[row] = _union([(c.start, c.end) for c in mine if c.kind in COMPUTE])
        explanation.transfer[row] = _union([(c.start, c.end) for c in mine if c.kind not in COMPUTE])
        cursor = start
        for c in mine:
            if c.start > cursor:
                explanation.idle += _attribute(row, cursor, c.start, consumers.get(c, c), ended, expected,
                                               stage_rows, rows, rule, bubble_only)
            cursor = max(cursor, c.end)
        if end > cursor:
            explanation.idle.append(Idle(row, cursor, end, "bubble"))
    return explanation


def _split_receives(cells: list[Span], ended: dict[Action, float],
                    rule: Schedule) -> tuple[list[Span], dict[Span, Span]]:
    """A receive (process runner) blocks until the sender has produced the message: the part of a
    ``recv`` span before the awaited action ended is waiting, not transfer. Returns the row's cells
    with each receive cut to its transfer part, and for each cut receive the action that consumes it."""
    kept: list[Span] = []
    consumers: dict[Span, Span] = {}
    for k, c in enumerate(cells):
        consumer = None
        if c.kind == "recv" and c.microbatch is not None:
            consumer = next((d for d in cells[k + 1:] if d.kind in _PHASE and d.microbatch == c.microbatch
                             and d.stage == c.stage and d.segment == 0), None)
        if consumer is None:
            kept.append(c)
            continue
        dependency = rule._dependency(Action(_PHASE[consumer.kind], consumer.microbatch or 0, consumer.stage or 0))
        arrived = min(max(ended.get(dependency, c.start) if dependency else c.start, c.start), c.end)
        if arrived < c.end:
            rest = replace(c, start=arrived)
            kept.append(rest)
            consumers[rest] = consumer
    return kept, consumers


def _attribute(row: int, start: float, until: float, cell: Span, ended: dict[Action, float],
               expected: dict[Action, float], stage_rows: dict[int, int], rows: list[str], rule: Schedule,
               bubble_only: bool) -> list[Idle]:
    """The causes of the idle interval from ``start`` to ``until``, before ``cell`` (or the receive for it)."""
    label = cell.label + (f"@{cell.stage}" if cell.stage is not None else "")
    if cell.kind not in _PHASE or cell.microbatch is None or cell.stage is None or cell.segment > 0:
        return [Idle(row, start, until, "overhead", label)]
    action = Action(_PHASE[cell.kind], cell.microbatch, cell.stage)
    dependency = rule._dependency(action)
    if dependency is None or dependency not in ended or dependency.stage not in stage_rows:
        return [Idle(row, start, until, "overhead", label)]
    awaited, on = str(dependency), rows[stage_rows[dependency.stage]]
    ready = min(max(ended[dependency], start), until)
    parts: list[Idle] = []
    if ready > start:
        own = (ready - start) if bubble_only else min(ready - start, expected.get(action, 0.0))
        if own > 0:
            parts.append(Idle(row, start, start + own, "bubble", label, awaited, on))
        if start + own < ready:
            parts.append(Idle(row, start + own, ready, "wait", label, awaited, on))
    if until > ready:
        parts.append(Idle(row, ready, until, "overhead", label, awaited, on))
    return parts


