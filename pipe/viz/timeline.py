"""Timelines: rows of timed cells, the one shape that plans and recordings are drawn from.

A planned schedule (:mod:`pipe.viz.planned`) and a measured run
(:mod:`pipe.viz.measured`) both become a :class:`Timeline`: one row per stage
(or rank), cells with a kind (forward, backward, recompute, copy, send, recv),
a micro-batch and a start and end time. The renderers (text, SVG, HTML,
trace-event JSON) and the statistics (utilisation, bubble, micro-batches in
flight) read only this, so a plan and a measurement are drawn and measured the
same way.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

from pipe.core.deprecation import moved
from pipe.trace import complete_event

__all__: list[str] = []

#: Kinds in legend order; anything else is drawn as "other".
KIND_ORDER: tuple[str, ...] = ("forward", "backward", "input", "weight", "recompute", "copy", "send", "recv",
                               "gather", "reduce")

#: Kinds that count as busy in utilisation and bubble: compute. Copies, sends and
#: receives (which include waiting for the peer) are drawn but are not compute.
COMPUTE: frozenset[str] = frozenset({"forward", "backward", "input", "weight", "recompute"})

#: The letter of each kind in labels (``F3``) and text timelines.
LETTERS: dict[str, str] = {"forward": "F", "backward": "B", "input": "I", "weight": "W", "recompute": "R",
                           "copy": "C", "send": "S", "recv": "V", "gather": "G", "reduce": "D"}


@dataclass(frozen=True, slots=True)  # slots: plans of millions of cells (pipe-viz plan) in less memory
class Span:
    """One span of work on one row.

    Attributes:
        row: index into :attr:`Timeline.rows`.
        kind: "forward", "backward", "input" and "weight" (the two halves of a split
            backward), "recompute", "copy", "send", "recv" (waiting for a
            message), "gather" (FSDP's, and the wait for it) and "reduce", ...
        start, end: in the timeline's unit, ``end >= start``.
        microbatch: the micro-batch, or None when unknown.
        stage: the model stage (virtual stage in interleaved schedules).
        chunk: which of its row's model chunks the stage is (0 unless interleaved).
        segment: the index of this piece when autograd interleaved the cell's
            backward with other work (:mod:`pipe.trace`); 0 for the first or only one.
    """

    row: int
    kind: str
    start: float
    end: float
    microbatch: Optional[int] = None
    stage: Optional[int] = None
    chunk: int = 0
    segment: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """``F3`` for the forward of micro-batch 3 (the trace-event name)."""
        return LETTERS.get(self.kind, "?") + ("" if self.microbatch is None else str(self.microbatch))


_START, _END = operator.attrgetter("start"), operator.attrgetter("end")


@dataclass
class Timeline:
    """Rows of cells over time, with what is needed to title and explain them.

    Attributes:
        title: one line naming the configuration.
        rows: row names, e.g. ``["stage 0", "stage 1"]``.
        cells: the work.
        unit: ``"step"`` (planned: one forward takes 1) or ``"ms"`` (measured).
        chunks: model chunks per row (virtual stages); shades tell them apart.
        peak_inflight: per row, the most micro-batches holding activations at once.
        notes: extra lines for the legend or table (e.g. how it was measured).
    """

    title: str
    rows: list[str]
    cells: list[Span]
    unit: str = "step"
    chunks: int = 1
    peak_inflight: Optional[list[int]] = None
    notes: list[str] = field(default_factory=list)

    @property
    def origin(self) -> float:
        return min(map(_START, self.cells), default=0.0)

    @property
    def end(self) -> float:
        return max(map(_END, self.cells), default=0.0)

    @property
    def makespan(self) -> float:
        """From the first start to the last end, over all rows."""
        return self.end - self.origin

    def by_row(self) -> list[list[Span]]:
        """The cells of each row (one pass over the cells; statistics of every row use it)."""
        rows: list[list[Span]] = [[] for _ in self.rows]
        for c in self.cells:
            rows[c.row].append(c)
        return rows

    def busy(self, row: int) -> float:
        """Time ``row`` spends computing: the union of its forward, backward and
        recompute cells (overlaps count once; transfers do not count)."""
        return _busy([c for c in self.cells if c.row == row])

    def busy_per_row(self) -> list[float]:
        """:meth:`busy` of every row, in one pass over the cells."""
        return [_busy(cells) for cells in self.by_row()]

    def utilisation(self) -> list[float]:
        """Per row, compute time over the makespan."""
        span = self.makespan
        return [busy / span if span > 0 else 0.0 for busy in self.busy_per_row()]

    def bubble(self) -> float:
        """The idle share of all rows over the makespan: ``1 - busy / (rows * makespan)``."""
        usage = self.utilisation()
        return 1.0 - sum(usage) / len(usage) if usage else 0.0

    def count(self, row: int, kind: str) -> int:
        """How many cells of ``kind`` ``row`` ran (a backward in segments counts once)."""
        return sum(1 for c in self.cells if c.row == row and c.kind == kind and c.segment == 0)

    def counts(self) -> list[dict[str, int]]:
        """:meth:`count` of every row and kind, in one pass."""
        result: list[dict[str, int]] = [{} for _ in self.rows]
        for c in self.cells:
            if c.segment == 0:
                result[c.row][c.kind] = result[c.row].get(c.kind, 0) + 1
        return result

    def durations(self, kind: str) -> list[float]:
        """The time of each cell of ``kind``, the segments of a backward summed."""
        totals: list[float] = []
        open_cells: dict[tuple[int, Optional[int], Optional[int]], int] = {}
        for c in sorted(self.cells, key=lambda c: c.start):
            if c.kind != kind:
                continue
            key = (c.row, c.microbatch, c.stage)
            if c.segment == 0 or key not in open_cells:
                open_cells[key] = len(totals)
                totals.append(0.0)
            totals[open_cells[key]] += c.duration
        return totals

    def kinds(self) -> list[str]:
        """The kinds present, in legend order (unknown kinds last)."""
        present = {c.kind for c in self.cells}
        return [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))

    def measured_inflight(self) -> list[int]:
        """Per row, the most micro-batches whose forward has ended and whose backward (or W) has not.

        The measured counterpart of ``Schedule.peak_inflight`` (events in time order;
        a backward in segments ends with its last one; a split one with its W).
        """
        peaks = []
        for row in range(len(self.rows)):
            moments: list[tuple[float, int]] = []
            backward_ends: list[float] = []  # of each backward's last segment
            open_cells: dict[tuple[Optional[int], Optional[int]], int] = {}
            for c in sorted(self.cells, key=lambda c: c.start):
                if c.row == row and c.kind == "forward":
                    moments.append((c.end, +1))
                elif c.row == row and c.kind in ("backward", "weight"):
                    key = (c.microbatch, c.stage)
                    if c.segment == 0 or key not in open_cells:
                        open_cells[key] = len(backward_ends)
                        backward_ends.append(c.end)
                    backward_ends[open_cells[key]] = c.end
            moments += [(end, -1) for end in backward_ends]
            held = peak = 0
            for _, delta in sorted(moments, key=lambda m: (m[0], m[1])):
                held += delta
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def to_trace(self, us_per_unit: Optional[float] = None) -> dict[str, Any]:
        """The timeline as Chrome trace-event JSON; ``tid`` is the row.

        Planned steps are written as milliseconds (one step = 1000 us) unless
        ``us_per_unit`` says otherwise; measured ms as microseconds.
        """
        scale = us_per_unit if us_per_unit is not None else 1000.0
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": self.title}}
        ]
        for row, name in enumerate(self.rows):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": row, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": row, "args": {"sort_index": row}})
        origin = self.origin
        for c in sorted(self.cells, key=lambda c: (c.start, c.row)):
            event = complete_event(c.kind, c.microbatch, c.stage, (c.start - origin) * scale, c.duration * scale, 0)
            event["tid"] = c.row
            events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"title": self.title, "unit": self.unit, "bubble": self.bubble()}}


def _busy(cells: list[Span]) -> float:
    """The union of the compute cells' intervals among ``cells``."""
    intervals = sorted((c.start, c.end) for c in cells if c.kind in COMPUTE)
    total, reach = 0.0, -math.inf
    for start, end in intervals:
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


__getattr__ = moved(__name__, __name__, {"Cell": "Span"})  # the old name, one release
