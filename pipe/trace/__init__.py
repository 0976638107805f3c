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
import os
import threading
from typing import Any, ContextManager, Iterator, Optional, Sequence, Union

import torch

from pipe.trace.events import KINDS, Cell, TraceError, complete_event, load, merge, validate
from pipe.trace.recorder import Recorder, _Span

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

#: The recorder of this process, or None when nothing is recorded.
_current: Optional[Recorder] = None
_recording_lock = threading.Lock()
_NO_SPAN: ContextManager[None] = contextlib.nullcontext()


# -- the process's recorder ----------------------------------------------------------


def active() -> Optional[Recorder]:
    """The recorder of this process, or None when nothing is being recorded."""
    return _current


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
    global _current
    new = Recorder(rank, **config)
    with _recording_lock:
        if _current is not None:
            raise RuntimeError(
                "a trace is already being recorded in this process; "
                "end the other pipe.trace.record() block first (recordings do not nest)"
            )
        _current = new
    try:
        yield new
    finally:
        with _recording_lock:
            _current = None
        if path is not None:
            new.save(path)


def span(kind: str, cell: Cell = None, **args: Any) -> ContextManager[None]:
    """Times the body as a span when recording; a no-op context otherwise.

    Args:
        kind: one of :data:`KINDS` (others are kept and drawn as "other").
        cell: (micro-batch, stage), or None.
        args: extra fields for the event (e.g. ``peer=3`` for a send).
    """
    current = _current
    if current is None:
        return _NO_SPAN
    return _Span(current, kind, cell, args)


def watch_backward(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], cell: Cell) -> None:
    """:meth:`Recorder.watch_backward` on the active recorder; nothing when not recording."""
    current = _current
    if current is not None:
        current.watch_backward(inputs, outputs, cell)
