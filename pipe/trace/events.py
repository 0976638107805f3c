"""The trace file: Chrome trace-event JSON as ``pipe`` writes, reads and merges it.

One format for recorded runs (:mod:`pipe.trace.recorder`) and planned
timelines (:mod:`pipe.viz`), so both open alike in Perfetto and in ``pipe-viz``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

__all__: list[str] = []

#: What a span measures, with the prefix of its event name ("F3": forward of micro-batch 3).
KINDS: dict[str, str] = {
    "forward": "F",
    "backward": "B",
    "recompute": "R",
    "input": "I",
    "weight": "W",
    "copy": "C",
    "send": "send ",
    "recv": "recv ",
    "gather": "gather ",  # FSDP: a stage's parameters gathered (issued, or waited for)
    "reduce": "reduce ",  # FSDP's reduce-scatter, or the replicas' average, of a stage's gradients
}

FORMAT_VERSION = 1

Cell = Optional[tuple[int, int]]  # (micro-batch, stage), or None when unknown


class TraceError(ValueError):
    """A trace file cannot be read or is not a Chrome trace of the expected shape."""


def complete_event(
    kind: str, microbatch: Optional[int], stage: Optional[int], ts_us: float, dur_us: float,
    pid: int, **args: Any,
) -> dict[str, Any]:
    """One Chrome "complete" event (``"ph": "X"``) for a span of ``kind``.

    Used for recorded spans and for planned timelines, so both read the same
    in Perfetto: name ``F3`` (kind prefix and micro-batch), ``pid`` the rank,
    ``tid`` the stage, times in microseconds.
    """
    name = KINDS.get(kind, kind) + ("" if microbatch is None else str(microbatch))
    event_args: dict[str, Any] = {"phase": kind}
    if microbatch is not None:
        event_args["microbatch"] = microbatch
    if stage is not None:
        event_args["stage"] = stage
    event_args.update(args)
    return {
        "name": name.strip(),
        "cat": kind,
        "ph": "X",
        "ts": ts_us,
        "dur": dur_us,
        "pid": pid,
        "tid": 0 if stage is None else stage,
        "args": event_args,
    }


def metadata_events(rank: int, stages: Sequence[int]) -> list[dict[str, Any]]:
    """Names and order of the rows Perfetto shows: ``rank r`` processes, ``stage s`` threads."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for stage in stages:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": stage,
                       "args": {"sort_index": stage}})
    return events


def validate(trace: Any, source: str = "trace") -> None:
    """Checks that ``trace`` is a Chrome trace-event JSON object this package can draw.

    Required: an object with a ``traceEvents`` list; every event an object with
    a string ``name`` and ``ph``; complete events (``"ph": "X"``) with numeric,
    finite ``ts`` and ``dur >= 0`` and integer ``pid`` and ``tid``.

    Raises:
        TraceError: naming the first problem and where it is.
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(
            f"{source} is not a Chrome trace: expected a JSON object with a 'traceEvents' list "
            f"(record one with pipe.trace.record(path) or examples/transformer_lm.py --trace PATH)"
        )
    for index, event in enumerate(trace["traceEvents"]):
        where = f"{source}: traceEvents[{index}]"
        if not isinstance(event, dict):
            raise TraceError(f"{where} is {type(event).__name__}, expected an object")
        for key in ("name", "ph"):
            if not isinstance(event.get(key), str):
                raise TraceError(f"{where} has {key}={event.get(key)!r}, expected a string")
        if event["ph"] != "X":
            continue
        for key in ("ts", "dur"):
            value = event.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TraceError(f"{where} ({event['name']}) has {key}={value!r}, expected a number of microseconds")
        if event["dur"] < 0:
            raise TraceError(f"{where} ({event['name']}) has dur={event['dur']}, expected >= 0")
        for key in ("pid", "tid"):
            value = event.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TraceError(f"{where} ({event['name']}) has {key}={value!r}, expected an integer")


def load(path: Union[str, os.PathLike[str]]) -> dict[str, Any]:
    """Reads and validates a trace file.

    Raises:
        TraceError: the file is missing, unreadable, not JSON or not a Chrome trace.
    """
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TraceError(f"cannot read trace {str(path)!r}: {error.strerror or error}") from error
    try:
        trace = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(f"trace {str(path)!r} is not JSON ({error.msg} at line {error.lineno})") from error
    validate(trace, repr(str(path)))
    return trace


def merge(traces: Sequence[Union[Mapping[str, Any], str, os.PathLike[str]]]) -> dict[str, Any]:
    """Puts the traces of several ranks on one clock, in one trace.

    Each file's times are shifted by the difference of the wall-clock origins
    saved by its recorder, so spans of different processes line up to within
    the hosts' clock agreement (exact on one machine).

    Raises:
        TraceError: no traces, an unreadable one, or a rank that appears twice.
    """
    if not traces:
        raise TraceError("merge() needs at least one trace")
    loaded = [dict(t) if isinstance(t, Mapping) else load(t) for t in traces]
    for index, trace in enumerate(loaded):
        validate(trace, f"trace {index}")
    origins = [float(t.get("otherData", {}).get("clock_origin_unix_us", 0.0)) for t in loaded]
    base = min(origins)
    events: list[dict[str, Any]] = []
    ranks: dict[int, int] = {}
    config: dict[str, Any] = {}
    for index, (trace, origin) in enumerate(zip(loaded, origins)):
        pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        for pid in pids:
            if pid in ranks:
                raise TraceError(
                    f"rank {pid} appears in trace {ranks[pid]} and trace {index}; "
                    f"merge one trace per rank (record each with rank=<its rank>)"
                )
            ranks[pid] = index
        config.update(trace.get("otherData", {}).get("config", {}))
        shift = origin - base
        for event in trace["traceEvents"]:
            if event.get("ph") == "X":
                event = dict(event, ts=event["ts"] + shift)
            events.append(event)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0), e.get("pid", 0), e.get("tid", 0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"pipe_trace": FORMAT_VERSION, "ranks": sorted(ranks), "clock_origin_unix_us": base,
                      "config": config},
    }
