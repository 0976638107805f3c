"""Measured timelines: record when each stage ran each micro-batch, as Chrome trace events.

A schedule on paper (:mod:`pipe.core.schedule`) says where a pipeline *should* be
idle; a recording says where it *was*. The engine calls :func:`span` around
forward, recompute, backward and copy work, and :func:`watch_backward` on each
non-checkpointed cell. While no recording is on, each of those is one function
call and one ``None`` check; ``with record():`` turns recording on for the
whole process::

    with pipe.trace.record("run.json") as recorder:
        loss = loss_fn(model(x), y)
        loss.backward()
    # run.json: Chrome trace-event JSON (open it in https://ui.perfetto.dev or
    # render it with `pipe-viz trace run.json -o run.html`)

The recorder knows nothing of threads or processes: a thread runner records
with ``rank=0`` and one row (``tid``) per stage; a process runner records one
file per rank (``record("run.{rank}.json", rank=rank)``), with ``"send"`` and
``"recv"`` spans around its point-to-point transfers, and :func:`merge` puts
the files on one clock.

How each kind is measured:

* ``forward``: wall time of the partition's forward in the worker thread.
* ``recompute``: ``Recompute.backward`` (the replayed forward).
* ``backward``: ``Checkpoint.backward`` for checkpointed cells. A
  non-checkpointed cell's backward is plain autograd inside the partition, so
  :func:`watch_backward` walks the cell's autograd nodes once after its forward
  and hooks each of them, so every node is timed. Autograd runs the nodes of
  several cells in one thread (on the CPU, all of them) and may interleave
  them; a run of the cell's nodes with nothing else recorded in between is
  one span, so an interleaved backward shows as several ``B3`` spans (with
  ``args.segment``) whose sum is the cell's backward time. Gradient
  accumulation into parameters (``AccumulateGrad``) and the engine's time
  between nodes are not counted.
* ``copy``: the host-side time of moving a micro-batch to the next device
  (on CUDA this is the time to *issue* the asynchronous copy).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, ContextManager, Iterator, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "KINDS",
    "Recorder",
    "TraceError",
    "active",
    "complete_event",
    "load",
    "merge",
    "record",
    "span",
    "validate",
    "watch_backward",
]

logger = logging.getLogger(__name__)

#: What a span measures, with the prefix of its event name ("F3": forward of micro-batch 3).
KINDS: dict[str, str] = {
    "forward": "F",
    "backward": "B",
    "recompute": "R",
    "input": "I",  # the input-gradient half of a split backward (zero-bubble schedules)
    "weight": "W",  # its weight-gradient half
    "copy": "C",
    "send": "send ",
    "recv": "recv ",
}

FORMAT_VERSION = 1

Cell = Optional[tuple[int, int]]  # (micro-batch, stage), or None when unknown

#: The recorder of this process, or None when nothing is recorded.
recorder: Optional["Recorder"] = None
_recording_lock = threading.Lock()
_NO_SPAN: ContextManager[None] = contextlib.nullcontext()


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


class _Ticks(threading.local):
    """A per-thread count of recorded happenings, to tell whether anything ran between two nodes."""

    def __init__(self) -> None:
        self.count = 0

    def tick(self) -> int:
        self.count += 1
        return self.count


class _Span:
    """A context manager that appends one event when it exits (no allocation per call beyond itself)."""

    __slots__ = ("recorder", "kind", "cell", "args", "start")

    def __init__(self, recorder: "Recorder", kind: str, cell: Cell, args: dict[str, Any]) -> None:
        self.recorder = recorder
        self.kind = kind
        self.cell = cell
        self.args = args
        self.start = 0

    def __enter__(self) -> None:
        self.recorder._ticks.tick()
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc: Any) -> None:
        end = time.perf_counter_ns()
        self.recorder._ticks.tick()
        self.recorder._events.append((self.kind, self.cell, self.start, end, self.args))


class _Backward:
    """The backward of one non-checkpointed cell, filled in by autograd node hooks.

    Every node of the cell times itself (pre-hook to post-hook). Consecutive
    nodes on one thread with nothing recorded in between extend one segment;
    a node of another cell, or any span, in between starts a new segment.
    """

    __slots__ = ("cell", "ticks", "node_start", "segments")

    def __init__(self, cell: Cell, ticks: _Ticks) -> None:
        self.cell = cell
        self.ticks = ticks
        self.node_start = 0
        # [start_ns, end_ns, tick of the last node, thread]
        self.segments: list[list[int]] = []

    def begin(self, grad_outputs: Any) -> None:
        self.node_start = time.perf_counter_ns()

    def finish(self, grad_inputs: Any, grad_outputs: Any) -> None:
        now = time.perf_counter_ns()
        tick = self.ticks.tick()
        thread = threading.get_ident()
        if self.segments:
            last = self.segments[-1]
            if last[2] == tick - 1 and last[3] == thread:
                last[1], last[2] = now, tick
                return
        self.segments.append([self.node_start, now, tick, thread])


class Recorder:
    """Collects the spans of one process (one rank).

    Args:
        rank: the process's rank; the ``pid`` of its events.
        config: what ran (schedule, stages, microbatches, checkpoint, ...),
            stored in the file for renderers (``pipe-viz trace --plan``).

    Spans are appended from any thread; the clock is ``time.perf_counter_ns``,
    anchored to the wall clock once so that files of several processes merge.
    """

    def __init__(self, rank: int = 0, **config: Any) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0 (got {rank!r}); pass the process's rank")
        self.rank = rank
        self.config: dict[str, Any] = dict(config)
        self._origin_ns = time.perf_counter_ns()
        self._origin_unix_us = time.time_ns() / 1000.0
        self._events: list[tuple[Any, ...]] = []
        self._backwards: list[_Backward] = []
        self._ticks = _Ticks()
        #: Autograd nodes hooked by watch_backward so far (each costs two Python calls in backward).
        self.hooked_nodes = 0

    def annotate(self, **config: Any) -> None:
        """Adds to the configuration saved with the trace (JSON-serialisable values)."""
        self.config.update(config)

    def span(self, kind: str, cell: Cell = None, **args: Any) -> ContextManager[None]:
        """Times the body as one span of ``kind`` for ``cell`` = (micro-batch, stage)."""
        return _Span(self, kind, cell, args)

    def add(self, kind: str, cell: Cell, start_ns: int, end_ns: int, **args: Any) -> None:
        """Adds a span measured elsewhere, in ``time.perf_counter_ns`` units."""
        self._events.append((kind, cell, start_ns, end_ns, args))

    def watch_backward(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], cell: Cell) -> None:
        """Records the coming backward of the autograd graph between ``inputs`` and ``outputs``.

        Walks the nodes created by the cell (stopping at the inputs' nodes and
        at parameters) and hooks each: its pre- and post-hook time it, and runs
        of the cell's nodes uninterrupted by other recorded work become spans.
        """
        roots = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not roots:
            return
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        span = _Backward(cell, self._ticks)
        self._backwards.append(span)
        seen: set[Any] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in seen or node in stop:
                continue
            seen.add(node)
            self.hooked_nodes += 1
            node.register_prehook(span.begin)
            node.register_hook(span.finish)
            for child, _ in node.next_functions:
                if child is not None and type(child).__name__ != "AccumulateGrad":
                    stack.append(child)

    def trace(self) -> dict[str, Any]:
        """The recording as a Chrome trace-event JSON object."""
        origin = self._origin_ns
        events: list[dict[str, Any]] = []
        spans = list(self._events)
        for b in self._backwards:
            many = len(b.segments) > 1
            for index, (start, end, _, _) in enumerate(b.segments):
                spans.append(("backward", b.cell, start, end, {"segment": index} if many else {}))
        stages: set[int] = set()
        for kind, cell, start, end, args in spans:
            microbatch, stage = cell if cell is not None else (None, None)
            if stage is not None:
                stages.add(stage)
            events.append(complete_event(
                kind, microbatch, stage, (start - origin) / 1000.0, (end - start) / 1000.0, self.rank, **args
            ))
        events.sort(key=lambda e: (e["ts"], e["tid"]))
        return {
            "traceEvents": _metadata(self.rank, sorted(stages)) + events,
            "displayTimeUnit": "ms",
            "otherData": {
                "pipe_trace": FORMAT_VERSION,
                "rank": self.rank,
                "clock_origin_unix_us": self._origin_unix_us,
                "config": self.config,
            },
        }

    def save(self, path: Union[str, os.PathLike[str]]) -> Path:
        """Writes :meth:`trace` to ``path`` (``{rank}`` in the name is replaced by the rank)."""
        target = Path(str(path).replace("{rank}", str(self.rank)))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.trace()))
        logger.info("wrote %d trace events of rank %d to %s", len(self._events) + len(self._backwards),
                    self.rank, target)
        return target


def _metadata(rank: int, stages: Sequence[int]) -> list[dict[str, Any]]:
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


# -- the process's recorder ----------------------------------------------------------


def active() -> Optional[Recorder]:
    """The recorder of this process, or None when nothing is being recorded."""
    return recorder


@contextlib.contextmanager
def record(path: Union[str, os.PathLike[str], None] = None, *, rank: int = 0, **config: Any) -> Iterator[Recorder]:
    """Records every span of this process inside the ``with`` block.

    Args:
        path: where to write the trace on exit (also on an exception), or None
            to keep it in memory (``recorder.trace()``, ``recorder.save(path)``).
            ``{rank}`` in the path is replaced by ``rank``.
        rank: this process's rank (0 for the thread pipeline).
        config: saved with the trace, e.g. ``schedule="1f1b"``.

    Raises:
        RuntimeError: a recording is already on in this process.

    Example::

        with pipe.trace.record("run.{rank}.json", rank=dist.get_rank(), schedule="1f1b"):
            train_step()
    """
    global recorder
    new = Recorder(rank, **config)
    with _recording_lock:
        if recorder is not None:
            raise RuntimeError(
                "a trace is already being recorded in this process; "
                "end the other pipe.trace.record() block first (recordings do not nest)"
            )
        recorder = new
    try:
        yield new
    finally:
        with _recording_lock:
            recorder = None
        if path is not None:
            new.save(path)


def span(kind: str, cell: Cell = None, **args: Any) -> ContextManager[None]:
    """Times the body as a span when recording; a no-op context otherwise.

    Args:
        kind: one of :data:`KINDS` (others are kept and drawn as "other").
        cell: (micro-batch, stage), or None.
        args: extra fields for the event (e.g. ``peer=3`` for a send).
    """
    current = recorder
    if current is None:
        return _NO_SPAN
    return _Span(current, kind, cell, args)


def watch_backward(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], cell: Cell) -> None:
    """:meth:`Recorder.watch_backward` on the active recorder; nothing when not recording."""
    current = recorder
    if current is not None:
        current.watch_backward(inputs, outputs, cell)


# -- trace files ---------------------------------------------------------------------------


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
