"""Tests for pipe.viz.html: the page with SVG, table and notes."""
from __future__ import annotations

from pipe.viz.html import render_html
from pipe.viz.planned import schedule_timeline


def test_page_holds_svg_table_and_escaped_title() -> None:
    timeline = schedule_timeline("1f1b", 2, 4)  # bubble (K - 1) / (M + K - 1) = 1/5 over 15 steps
    page = render_html([timeline], title="a <b> & c")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 1
    assert "<title>a &lt;b&gt; &amp; c</title>" in page
    assert "<th>utilisation</th>" in page and "<th>peak micro-batches in flight</th>" in page
    assert "<tr><td>stage 0</td><td>80.0%</td><td>12</td><td>4</td><td>4</td><td>2</td></tr>" in page
    assert "bubble 20.0% = idle share of 2 rows × 15 steps" in page
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
