"""Text timelines for terminals: one line per stage, ``F3``/``B3``/``R3`` cells, ``.`` for idle.

A plan in time steps gets three characters per step, as the diagrams in
:mod:`pipe.core.schedule` do::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3--- B2--- B1--- B0---
    stage 1 | .  F0 F1 F2 F3 .  .  .  .  B3--- B2--- B1--- B0--- .

A measured timeline (milliseconds) is scaled to a fixed width instead; cells
too narrow for their label show only the kind's letter.
"""
from __future__ import annotations

import math
from typing import Sequence

from pipe.viz.timeline import COMPUTE, LETTERS, Timeline

__all__: list[str] = []



def nice_step(span: float, target: int) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about ``target`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / max(1, target)
    power = 10.0 ** math.floor(math.log10(raw))
    for factor in (1.0, 2.0, 5.0, 10.0):
        if raw <= factor * power:
            return factor * power
    return 10.0 * power


def render_text(timelines: Sequence[Timeline], width: int = 100) -> str:
    """Draws each timeline as text; ``width`` is the character width of a measured timeline."""
    return "\n".join(_render(t, width) for t in timelines)


def _render(timeline: Timeline, width: int) -> str:
    origin = timeline.origin
    span = timeline.end - origin  # timeline.makespan, without a third pass over the cells
    # A plan whose times are multiples of its shortest cell gets three characters per such quantum.
    quantum = min((c.duration for c in timeline.cells if c.duration > 0), default=1.0)
    grid = timeline.unit == "step" and span / quantum * 3 <= max(width, 240) and all(
        abs(t / quantum - round(t / quantum)) < 1e-6 for c in timeline.cells for t in (c.start - origin, c.end - origin)
    )
    per_unit = 3.0 / quantum if grid else (width / span if span > 0 else 1.0)
    columns = max(1, math.ceil(span * per_unit - 1e-9))
    name_width = max(len(name) for name in timeline.rows)
    lines = [timeline.title, ""]
    by_row = timeline.by_row()
    for row, name in enumerate(timeline.rows):
        line = [("." if k % 3 == 0 else " ") if grid else "." for k in range(columns)]
        # Waits first, communication over them, compute last: a gather shows where the row waits for it.
        for cell in sorted(by_row[row], key=lambda c: (2 if c.kind in COMPUTE else c.kind != "recv", c.start)):
            a = int(round((cell.start - origin) * per_unit))
            if a >= columns:
                continue
            b = int(round((cell.end - origin) * per_unit))
            if b <= a + 1 and not grid:  # one character (most cells of a large plan): the kind's letter
                letter = LETTERS.get(cell.kind, "?")
                line[a] = letter if cell.chunk == 0 else letter.lower()
                continue
            b = min(max(a + 1, b), columns)
            size = b - a
            label = cell.label if cell.chunk == 0 else cell.label.lower()
            if grid or size > len(label) + 2:
                text = (label + "-" * size)[: size - 1] + " "
            elif size > len(label):
                text = (label + "-" * size)[:size]
            else:
                text = label[:size]
            line[a:b] = list(text)
        lines.append(f"{name:<{name_width}} | " + "".join(line).rstrip())
    lines.append(_axis(timeline, name_width, per_unit, columns, span))
    lines.append("")
    usage = timeline.utilisation()
    bubble = 1.0 - sum(usage) / len(usage) if usage else 0.0  # Timeline.bubble(), without a second pass
    peaks = timeline.peak_inflight or [None] * len(timeline.rows)  # type: ignore[list-item]
    kinds, per_row = timeline.kinds(), timeline.counts()
    for row, name in enumerate(timeline.rows):
        counts = "  ".join(f"{LETTERS.get(k, '?')} {per_row[row].get(k, 0)}" for k in kinds)
        peak = "" if peaks[row] is None else f"  peak in flight {peaks[row]}"
        lines.append(f"{name:<{name_width}}   busy {usage[row]:6.1%}  {counts}{peak}")
    unit = "steps" if timeline.unit == "step" else "ms"
    lines.append(f"bubble {bubble:.1%} of {len(timeline.rows)} rows × {span:g} {unit}"
                 if timeline.unit == "step" else
                 f"bubble {bubble:.1%} of {len(timeline.rows)} rows × {span:.2f} {unit}")
    lines.extend(timeline.notes)
    legend = [f"{LETTERS.get(k, '?')} {k}" for k in timeline.kinds()] + [". idle", "numbers are micro-batches"]
    if timeline.chunks > 1:
        legend.append("lower case: later model chunks")
    lines.append(" · ".join(legend))
    lines.append("")
    return "\n".join(lines)


def _axis(timeline: Timeline, name_width: int, per_unit: float, columns: int, span: float) -> str:
    """Tick labels under the rows (``span``: the makespan), in steps or milliseconds."""
    unit = "steps" if timeline.unit == "step" else "ms"
    tick = nice_step(span, max(1, columns // 10))
    axis = [" "] * (columns + 8)
    value = 0.0
    while value <= span + 1e-9:
        label = f"{value:g}"
        position = int(round(value * per_unit))
        if position + len(label) <= len(axis) and all(c == " " for c in axis[max(0, position - 1):position + len(label)]):
            axis[position:position + len(label)] = list(label)
        value += tick
    return f"{unit:>{name_width}} | " + "".join(axis).rstrip()
