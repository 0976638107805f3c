"""SVG timelines: stage rows over time, coloured by kind, micro-batch numbers in the cells.

Written by hand rather than with matplotlib: the picture is rectangles, text
and a legend, a plain SVG string keeps ``pipe`` free of a plotting dependency,
renders crisply at any zoom, and lets a browser show a tooltip per cell
(``<title>``). Several timelines (a measurement and its plan) stack as panels
on one time scale, so they can be compared by eye.
"""
from __future__ import annotations

from typing import Optional, Sequence
from xml.sax.saxutils import escape

from pipe.viz.text import nice_step
from pipe.viz.timeline import COMPUTE, Span, Timeline

__all__: list[str] = []

#: Fill colour of each kind (Tableau 10: distinct, and readable with white text).
COLOURS: dict[str, str] = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "input": "#e15759",  # the input-gradient half of a split backward
    "weight": "#edc948",  # the weight-gradient half, deferred into what would be bubble
    "recompute": "#59a14f",
    "copy": "#b07aa1",
    "send": "#9c755f",
    "recv": "#bab0ac",
    "gather": "#76b7b2",
    "reduce": "#ff9da7",
}
_OTHER = "#7f7f7f"
_IDLE = "#eeeeee"
_FONT = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""

# Layout, in pixels.
_LEFT = 150  # row names and utilisation
_RIGHT = 24
_ROW = 30
_GAP = 6
_MARK = 8  # the height of a communication mark
_TITLE = 54  # title and note above the rows
_AXIS = 44  # ticks and axis caption below the rows
_LEGEND = 30


def _lighter(colour: str, amount: float) -> str:
    """``colour`` mixed with white by ``amount`` (0: unchanged, 1: white)."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _fill(cell: Span, chunks: int) -> str:
    base = COLOURS.get(cell.kind, _OTHER)
    if chunks <= 1 or cell.chunk == 0:
        return base
    return _lighter(base, 0.5 * cell.chunk / (chunks - 1))


def _unit_caption(timeline: Timeline) -> str:
    return "time (steps; one forward = 1)" if timeline.unit == "step" else "time (ms)"


def panel_height(timeline: Timeline) -> int:
    return _TITLE + len(timeline.rows) * (_ROW + _GAP) + _AXIS + _LEGEND


def _panel(timeline: Timeline, top: float, width: int, span: float) -> list[str]:
    """The SVG elements of one timeline, ``top`` pixels down, ``span`` time units wide."""
    out: list[str] = []
    plot = width - _LEFT - _RIGHT
    scale = plot / span if span > 0 else 1.0
    origin = timeline.origin
    out.append(f'<text x="12" y="{top + 22:.0f}" font-size="17" font-weight="bold" {_FONT}>'
               f"{escape(timeline.title)}</text>")
    if timeline.notes:
        out.append(f'<text x="12" y="{top + 42:.0f}" font-size="12" fill="#555" {_FONT}>'
                   f"{escape(timeline.notes[0])}</text>")
    usage = timeline.utilisation()
    rows_top = top + _TITLE
    for row, name in enumerate(timeline.rows):
        y = rows_top + row * (_ROW + _GAP)
        out.append(f'<text x="12" y="{y + _ROW / 2 + 5:.1f}" font-size="14" font-weight="bold" {_FONT}>'
                   f"{escape(name)}</text>")
        out.append(f'<text x="{_LEFT - 10}" y="{y + _ROW / 2 + 5:.1f}" font-size="12" fill="#555" '
                   f'text-anchor="end" {_FONT}>{usage[row]:.0%} busy</text>')
        out.append(f'<rect x="{_LEFT}" y="{y:.1f}" width="{plot:.1f}" height="{_ROW}" fill="url(#idle)">'
                   f"<title>{escape(name)}: idle {1 - usage[row]:.1%}</title></rect>")
    for cell in sorted(timeline.cells, key=lambda c: (c.row, c.start)):
        x = _LEFT + (cell.start - origin) * scale
        w = max(cell.duration * scale, 1.0)
        y = rows_top + cell.row * (_ROW + _GAP)
        height = float(_ROW)
        if cell.kind not in COMPUTE:  # communication and copies: a thin mark along the row's foot
            y, height = y + _ROW - _MARK, float(_MARK)
        fill = _fill(cell, timeline.chunks)
        when = (f"{cell.start - origin:g}–{cell.end - origin:g} steps" if timeline.unit == "step"
                else f"{cell.start - origin:.3f}–{cell.end - origin:.3f} ms ({cell.duration:.3f} ms)")
        where = "" if cell.stage is None else f" · model stage {cell.stage}"
        tip = f"{cell.kind} of micro-batch {cell.microbatch}{where} · {when}"
        out.append(f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{height:g}" fill="{fill}" '
                   f'stroke="#fff" stroke-width="1"><title>{escape(tip)}</title></rect>')
        if cell.microbatch is not None and height == _ROW:
            text = str(cell.microbatch)
            if w >= 7 * len(text) + 4:
                dark = cell.chunk > 0 and timeline.chunks > 1 or cell.kind == "recv"
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4.5:.1f}" font-size="13" '
                           f'text-anchor="middle" fill="{"#222" if dark else "#fff"}" {_FONT} '
                           f'pointer-events="none">{text}</text>')
    # Time axis.
    axis_y = rows_top + len(timeline.rows) * (_ROW + _GAP) + 2
    out.append(f'<line x1="{_LEFT}" y1="{axis_y:.1f}" x2="{_LEFT + plot:.1f}" y2="{axis_y:.1f}" stroke="#333"/>')
    tick = nice_step(span, 12)
    value = 0.0
    while value <= span + 1e-9:
        x = _LEFT + value * scale
        out.append(f'<line x1="{x:.1f}" y1="{axis_y:.1f}" x2="{x:.1f}" y2="{axis_y + 5:.1f}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 18:.1f}" font-size="11" text-anchor="middle" {_FONT}>'
                   f"{value:g}</text>")
        value += tick
    out.append(f'<text x="{_LEFT + plot / 2:.1f}" y="{axis_y + 34:.1f}" font-size="12" text-anchor="middle" '
               f'fill="#333" {_FONT}>{_unit_caption(timeline)}</text>')
    out.extend(_legend(timeline, axis_y + _AXIS + 4))
    return out


def _legend(timeline: Timeline, y: float) -> list[str]:
    out: list[str] = []
    x = float(_LEFT)
    items = [(kind, COLOURS.get(kind, _OTHER)) for kind in timeline.kinds()] + [("idle", "url(#idle)")]
    if timeline.chunks > 1:
        items.append((f"later model chunk{'s' if timeline.chunks > 2 else ''} (lighter)",
                      _lighter(COLOURS["forward"], 0.5)))
    for name, fill in items:
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="16" height="16" fill="{fill}" stroke="#999" '
                   f'stroke-width="0.5"/>')
        out.append(f'<text x="{x + 22:.1f}" y="{y + 13:.1f}" font-size="13" {_FONT}>{escape(name)}</text>')
        x += 22 + 7.5 * len(name) + 18
    out.append(f'<text x="{x:.1f}" y="{y + 13:.1f}" font-size="13" fill="#555" {_FONT}>'
               f"numbers: micro-batch</text>")
    return out


def render_svg(timelines: Sequence[Timeline], width: int = 1200, span: Optional[float] = None) -> str:
    """One SVG document with a panel per timeline.

    Args:
        timelines: drawn top to bottom.
        width: pixels.
        span: time covered by the x axis; default: the longest makespan among
            timelines of the same unit, so their panels share one scale.
    """
    parts: list[str] = []
    top = 0.0
    for timeline in timelines:
        shared = span if span is not None else max(t.makespan for t in timelines if t.unit == timeline.unit)
        parts.extend(_panel(timeline, top, width, shared))
        top += panel_height(timeline) + 10
    height = int(top)
    header = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">'
        '<defs><pattern id="idle" width="8" height="8" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        f'<rect width="8" height="8" fill="{_IDLE}"/><line x1="0" y1="0" x2="0" y2="8" stroke="#d0d0d0" '
        'stroke-width="3"/></pattern></defs>'
        f'<rect width="{width}" height="{height}" fill="#fff"/>'
    )
    return header + "\n" + "\n".join(parts) + "\n</svg>\n"
