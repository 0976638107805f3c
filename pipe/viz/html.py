"""HTML pages: each timeline's SVG with a table of per-stage utilisation and counts.

One self-contained file (no scripts, no network) that any browser opens; the
SVG carries the legend and per-cell tooltips, the table the numbers.
"""
from __future__ import annotations

from typing import Sequence
from xml.sax.saxutils import escape

from pipe.viz.svg import render_svg
from pipe.viz.timeline import Timeline

__all__: list[str] = []

_STYLE = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 12px; }
section { margin-bottom: 28px; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0 0 150px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 12px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
p.notes { font-size: 12px; color: #555; margin: 6px 0 0 150px; }
"""


def _table(timeline: Timeline) -> str:
    kinds = timeline.kinds()
    usage = timeline.utilisation()
    unit = "steps" if timeline.unit == "step" else "ms"
    head = "".join(f"<th>{escape(k)}</th>" for k in kinds)
    peak = timeline.peak_inflight is not None
    rows = []
    per_row, busy_per_row = timeline.counts(), timeline.busy_per_row()
    for row, name in enumerate(timeline.rows):
        counts = "".join(f"<td>{per_row[row].get(k, 0)}</td>" for k in kinds)
        busy = busy_per_row[row]
        extra = f"<td>{timeline.peak_inflight[row]}</td>" if peak else ""  # type: ignore[index]
        rows.append(f"<tr><td>{escape(name)}</td><td>{usage[row]:.1%}</td><td>{busy:.4g}</td>{counts}{extra}</tr>")
    peak_head = "<th>peak micro-batches in flight</th>" if peak else ""
    total = (f"<tr><td><b>all</b></td><td><b>{1 - timeline.bubble():.1%}</b></td>"
             f"<td>{sum(busy_per_row):.4g}</td>"
             + "<td></td>" * (len(kinds) + peak) + "</tr>")
    return (
        f"<table><tr><th>row</th><th>utilisation</th><th>busy ({unit})</th>{head}{peak_head}</tr>"
        + "".join(rows) + total + "</table>"
    )


def render_html(timelines: Sequence[Timeline], title: str = "pipe schedule") -> str:
    """A page with one section per timeline, all panels on one time scale per unit."""
    sections = []
    for timeline in timelines:
        span = max(t.makespan for t in timelines if t.unit == timeline.unit)
        unit = "steps" if timeline.unit == "step" else "ms"
        notes = escape(" · ".join(timeline.notes[1:] + [
            f"bubble {timeline.bubble():.1%} = idle share of {len(timeline.rows)} rows × "
            f"{timeline.makespan:.4g} {unit}"]))
        sections.append(
            f"<section>{render_svg([timeline], span=span)}{_table(timeline)}"
            f'<p class="notes">{notes}</p></section>'
        )
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>\n<h1>{escape(title)}</h1>\n"
        + "\n".join(sections) + "\n</body></html>\n"
    )
