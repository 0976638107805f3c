"""The recorder: collects the timed spans of one process and writes them as a trace file.

See :mod:`pipe.trace` for what each span measures and how recording is turned on.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, ContextManager, Sequence, Union

import torch

from pipe.trace.events import FORMAT_VERSION, Cell, complete_event, metadata_events

__all__: list[str] = []

logger = logging.getLogger(__name__)


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
            "traceEvents": metadata_events(self.rank, sorted(stages)) + events,
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
