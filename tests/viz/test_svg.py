"""Tests for pipe.viz.svg, and a look at the page in a real headless browser (Chromium)."""
from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from pipe.viz.html import render_html
from pipe.viz.measured import from_trace, schedule_like
from pipe.viz.planned import schedule_timeline
from pipe.viz.svg import COLOURS, render_svg

SVG = "{http://www.w3.org/2000/svg}"


def test_svg_is_well_formed_with_title_axis_legend_and_numbers() -> None:
    timeline = schedule_timeline("1f1b", 3, 4, checkpoint="always")
    root = ElementTree.fromstring(render_svg([timeline]))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert timeline.title in texts
    assert {"forward", "backward", "recompute", "idle", "numbers: micro-batch"} <= set(texts)
    assert "time (steps; one forward = 1)" in texts
    assert {"stage 0", "stage 1", "stage 2"} <= set(texts)
    assert [t for t in texts if t in {"0", "1", "2", "3"}]  # micro-batch numbers (and ticks)
    fills = [r.get("fill") for r in root.iter(f"{SVG}rect")]
    for kind in ("forward", "backward", "recompute"):
        # one per cell, plus the legend swatch
        assert fills.count(COLOURS[kind]) == sum(c.kind == kind for c in timeline.cells) + 1
    tips = [t.text for t in root.iter(f"{SVG}title")]
    assert "forward of micro-batch 0 · model stage 0 · 0–1 steps" in tips


def test_zero_bubble_svg_colours_input_and_weight_with_a_legend() -> None:
    timeline = schedule_timeline("zb-h1", 2, 3)
    root = ElementTree.fromstring(render_svg([timeline]))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert {"forward", "input", "weight"} <= set(texts) and "backward" not in texts
    fills = [r.get("fill") for r in root.iter(f"{SVG}rect")]
    assert len({COLOURS["input"], COLOURS["weight"], COLOURS["backward"], COLOURS["forward"]}) == 4
    for kind in ("input", "weight"):
        assert fills.count(COLOURS[kind]) == sum(c.kind == kind for c in timeline.cells) + 1


def test_panels_share_one_time_scale() -> None:
    short, long = schedule_timeline("gpipe", 2, 2), schedule_timeline("gpipe", 2, 8)
    root = ElementTree.fromstring(render_svg([short, long], width=1000))
    ticks = [(t.get("x"), t.text) for t in root.iter(f"{SVG}text") if t.get("font-size") == "11"]
    half = len(ticks) // 2
    assert ticks[:half] == ticks[half:] and ticks[-1][1] == "25"  # same ticks, up to the long makespan (27)
    left = 150  # where the time axis starts
    ends = [float(r.get("x")) + float(r.get("width")) - left
            for r in root.iter(f"{SVG}rect") if r.get("fill") == COLOURS["backward"]]
    assert max(ends[:4]) == pytest.approx(max(ends[4:]) * 9 / 27, abs=0.05)  # the short plan's 9 steps of the 27-step axis


def _png_size_and_colours(path: Path) -> tuple[int, int, int]:
    """Width, height and the number of distinct byte values of a PNG's pixel data."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    idat, offset = b"", 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind = data[offset + 4:offset + 8]
        if kind == b"IDAT":
            idat += data[offset + 8:offset + 8 + length]
        offset += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium for a headless screenshot "
                                             "(Debian: apt-get install chromium)")
def test_page_renders_in_a_headless_browser(tmp_path: Path, pipe_trace: dict[str, Any]) -> None:
    measured = from_trace(pipe_trace, step=0)
    page = tmp_path / "run.html"
    page.write_text(render_html([measured, schedule_like(measured, pipe_trace)], title="pipe-viz test"))
    shot = tmp_path / "run.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1400,900", page.as_uri()],
        check=True, timeout=120, capture_output=True,
    )
    width, height, colours = _png_size_and_colours(shot)
    assert (width, height) == (1400, 900)
    assert colours > 50, "the screenshot is (nearly) blank"
