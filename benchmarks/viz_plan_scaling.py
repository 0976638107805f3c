"""How ``pipe-viz plan`` scales: seconds per planned cell as stages x micro-batches grows.

``pipe-viz plan`` simulates the schedule's lowered programs (``pipe.core.program_time``), lays the timed
actions out as cells and draws them. Each size runs the whole command (text
to a discarded stream, as without ``-o``) in this process; the figure that
matters is the time per cell (2 x stages x micro-batches of them), which stays
flat when the work is linear. Both wall-clock and CPU seconds of the process
are reported: on a shared machine the wall clock mostly measures the other
processes, the CPU time what the command costs. Everything is measured in
this run, printed and saved to benchmarks/results/viz_plan_scaling.json.

Run:
    python benchmarks/viz_plan_scaling.py                 # 100 .. 800, then 2000 x 2000
    python benchmarks/viz_plan_scaling.py --sizes 100 200 400
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from pipe.viz.cli import main as pipe_viz

RESULTS = Path(__file__).resolve().parent / "results"


def run(size: int, schedule: str) -> tuple[float, float]:
    """Wall and CPU seconds of ``pipe-viz plan --schedule S --ranks N --microbatches N`` (text output)."""
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        pipe_viz(["plan", "--schedule", schedule, "--ranks", str(size), "--microbatches", str(size)])
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 200, 400, 800, 2000])
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        seconds, cpu = run(size, args.schedule)
        cells = 2 * size * size
        rows.append({"stages": size, "microbatches": size, "cells": cells, "seconds": seconds, "cpu_seconds": cpu,
                     "us_per_cell": seconds / cells * 1e6, "cpu_us_per_cell": cpu / cells * 1e6})
        print(f"{size:5d} x {size:<5d} {cells:>9d} cells  wall {seconds:8.2f} s ({seconds / cells * 1e6:6.2f} us/cell)"
              f"  cpu {cpu:8.2f} s ({cpu / cells * 1e6:6.2f} us/cell)", flush=True)
    first, last = rows[0], rows[-1]
    growth = (last["cpu_seconds"] / first["cpu_seconds"]) / (last["cells"] / first["cells"])
    print(f"CPU time grew {last['cpu_seconds'] / first['cpu_seconds']:.1f}x for {last['cells'] / first['cells']:.0f}x "
          f"the cells (1.0 = linear: {growth:.2f})")
    RESULTS.mkdir(exist_ok=True)
    result = {"schedule": args.schedule, "rows": rows, "cpu_time_growth_over_cell_growth": growth,
              "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "python": platform.python_version()}
    (RESULTS / "viz_plan_scaling.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
