"""Tests for pipe.trace: the recorder on a real Pipe, the Chrome trace-event format, load and merge."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipe import Pipe, trace
from pipe.trace import TraceError


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def run_recorded(checkpoint: str, chunks: int = 3) -> tuple[dict[str, Any], Pipe, nn.Sequential]:
    model = make_model()
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[2, 3], devices=["cpu", "cpu"])
    x = torch.randn(6, 4)
    with trace.record(schedule="gpipe") as recorder:
        piped(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    piped.close()
    return recorder.trace(), piped, plain


def spans(events: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Complete events by "name@stage", the segments of an interleaved backward joined into one."""
    out: dict[str, dict[str, Any]] = {}
    for e in sorted((e for e in events["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"]):
        key = f"{e['name']}@{e['tid']}"
        if key not in out:
            out[key] = dict(e, segments=1)
            continue
        first = out[key]
        assert e["cat"] == "backward" and e["args"]["segment"] == first["segments"], f"{key} recorded twice"
        first["dur"] = e["ts"] + e["dur"] - first["ts"]
        first["segments"] += 1
    return out


def cells(kind: str, microbatches: range, stages: range = range(2)) -> set[str]:
    return {f"{kind}{i}@{j}" for i in microbatches for j in stages}


@pytest.mark.parametrize(
    "checkpoint, recomputed",
    [("never", range(0)), ("always", range(3)), ("except_last", range(2))],
)
def test_recorder_captures_every_cell_of_a_real_pipe(checkpoint: str, recomputed: range) -> None:
    recorded, piped, plain = run_recorded(checkpoint)
    by_name = spans(recorded)
    assert set(by_name) == cells("F", range(3)) | cells("B", range(3)) | cells("R", recomputed)
    for i in range(3):
        # Forward flows down the stages, backward up; recompute precedes its backward.
        assert by_name[f"F{i}@0"]["ts"] + by_name[f"F{i}@0"]["dur"] <= by_name[f"F{i}@1"]["ts"]
        # (Autograd may still be finishing stage 1's weight gradients when stage 0 starts.)
        assert by_name[f"B{i}@1"]["ts"] < by_name[f"B{i}@0"]["ts"]
        assert by_name[f"F{i}@1"]["ts"] <= by_name[f"B{i}@1"]["ts"]
        for j in range(2):
            if i in recomputed:
                r, b = by_name[f"R{i}@{j}"], by_name[f"B{i}@{j}"]
                assert r["ts"] + r["dur"] <= b["ts"] + 1e-3
            event = by_name[f"F{i}@{j}"]
            assert event["args"] == {"phase": "forward", "microbatch": i, "stage": j}
            assert by_name[f"F{i}@{j}"]["segments"] == 1
            assert event["cat"] == "forward" and event["pid"] == 0 and event["tid"] == j
    assert recorded["otherData"]["config"] == {"schedule": "gpipe"}
    # On the CPU each stage's worker runs its recomputation and backward (pipe.threads.worker_backward):
    # one thread per stage, so a stage's backward-side spans never overlap.
    for stage in range(2):
        backward_side = sorted((e["ts"], e["ts"] + e["dur"]) for e in recorded["traceEvents"]
                               if e["ph"] == "X" and e["cat"] in ("backward", "recompute") and e["tid"] == stage)
        for (_, end), (start, _) in zip(backward_side, backward_side[1:]):
            assert end <= start + 1e-3
    # Recording changes no number: gradients equal the plain module's.
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_nothing_is_recorded_when_off() -> None:
    assert trace.active() is None
    with trace.span("forward", (0, 0)):
        pass
    trace.watch_backward([], [torch.ones(1, requires_grad=True) * 2], (0, 0))
    with trace.record() as recorder:
        assert trace.active() is recorder
    assert trace.active() is None
    assert [e for e in recorder.trace()["traceEvents"] if e["ph"] == "X"] == []


def test_eval_forward_records_forwards_only() -> None:
    piped = Pipe(make_model(), chunks=2, balance=[2, 3], devices=["cpu", "cpu"])
    with torch.no_grad(), trace.record() as recorder:
        piped(torch.randn(4, 4))
    piped.close()
    assert set(spans(recorder.trace())) == cells("F", range(2))


def test_trace_follows_the_chrome_trace_event_format() -> None:
    recorded, _, _ = run_recorded("except_last")
    json.loads(json.dumps(recorded))  # plain JSON
    assert recorded["displayTimeUnit"] == "ms"
    for event in recorded["traceEvents"]:
        assert isinstance(event["name"], str) and event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], float) and isinstance(event["dur"], float)
            assert event["ts"] >= 0 and event["dur"] >= 0
            assert event["cat"] in trace.KINDS and isinstance(event["args"], dict)
        else:
            assert event["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
    names = {e["args"]["name"] for e in recorded["traceEvents"] if e["name"].endswith("_name")}
    assert names == {"rank 0", "stage 0", "stage 1"}
    trace.validate(recorded)


def test_record_writes_the_file_on_exit_even_after_an_error(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        with trace.record(tmp_path / "run.{rank}.json", rank=3) as recorder:
            with recorder.span("send", (1, 2), peer=4):
                pass
            1 / 0
    loaded = trace.load(tmp_path / "run.3.json")
    (event,) = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert (event["name"], event["pid"], event["tid"]) == ("send 1", 3, 2)
    assert event["args"] == {"phase": "send", "microbatch": 1, "stage": 2, "peer": 4}
    assert loaded["otherData"]["rank"] == 3
    assert trace.active() is None


def test_recordings_do_not_nest() -> None:
    with trace.record():
        with pytest.raises(RuntimeError, match="already being recorded"):
            with trace.record():
                pass


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank must be an int >= 0 \(got -1\)"):
        trace.Recorder(rank=-1)


def test_merge_puts_ranks_on_one_clock(tmp_path: Path) -> None:
    files = []
    for rank in range(2):
        recorder = trace.Recorder(rank=rank)
        recorder.add("forward", (0, rank), recorder._origin_ns, recorder._origin_ns + 1000)
        data = recorder.trace()
        data["otherData"]["clock_origin_unix_us"] = 1_000_000.0 + 500.0 * rank  # rank 1 started 0.5 ms later
        files.append(tmp_path / f"r{rank}.json")
        files[-1].write_text(json.dumps(data))
    merged = trace.merge(files)
    trace.validate(merged)
    starts = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert starts == {0: 0.0, 1: 500.0}
    assert merged["otherData"]["ranks"] == [0, 1]
    with pytest.raises(TraceError, match="rank 0 appears in trace 0 and trace 1"):
        trace.merge([files[0], files[0]])
    with pytest.raises(TraceError, match="at least one"):
        trace.merge([])


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"cannot read trace .*missing\.json"),
        ("{not json", r"is not JSON"),
        ("[1, 2]", r"is not a Chrome trace: expected a JSON object with a 'traceEvents' list"),
        ('{"traceEvents": [{"name": "F0", "ph": "X", "ts": "0", "dur": 1, "pid": 0, "tid": 0}]}',
         r"traceEvents\[0\] \(F0\) has ts='0', expected a number"),
        ('{"traceEvents": [{"name": "F0", "ph": "X", "ts": 0, "dur": -1, "pid": 0, "tid": 0}]}',
         r"dur=-1, expected >= 0"),
        ('{"traceEvents": [{"name": "F0", "ph": "X", "ts": 0, "dur": 1, "pid": 0.5, "tid": 0}]}',
         r"pid=0.5, expected an integer"),
        ('{"traceEvents": [{"ph": "X"}]}', r"name=None, expected a string"),
    ],
)
def test_load_names_what_is_wrong(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceError, match=message):
        trace.load(path)
