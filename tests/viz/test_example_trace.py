"""The main example records a trace with one flag (--trace), and pipe-viz draws it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pipe import trace
from pipe.viz.cli import main as pipe_viz
from pipe.viz.measured import from_trace

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformer_lm.py"


def test_transformer_lm_records_a_trace_with_one_flag(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("transformer_lm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run = tmp_path / "run.json"
    example.main(["--steps", "3", "--layers", "2", "--width", "16", "--heads", "2", "--batch-size", "4",
                  "--seq-len", "16", "--chunks", "2", "--eval-every", "0", "--eval-batches", "1",
                  "--trace", str(run)])
    assert trace.active() is None
    timeline = from_trace(trace.load(run))  # step 2 only: steps 0 and 1 warm up
    assert timeline.rows == ["stage 0", "stage 1"]
    for row in range(2):
        assert (timeline.count(row, "forward"), timeline.count(row, "backward"),
                timeline.count(row, "recompute")) == (2, 2, 1)  # except_last: micro-batch 0 recomputes
    assert "checkpoint=except_last" in timeline.title
    assert pipe_viz(["trace", str(run), "--plan", "-o", str(tmp_path / "run.html")]) == 0
