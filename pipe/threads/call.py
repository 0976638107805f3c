"""Calls: the identity of one use of a pipeline, so that its work is told apart, cancelled and waited for.

Every task a forward hands to the workers belongs to a :class:`Call`, and a
worker reports the task's result to that call's own queues, never to a queue
shared between calls. A call that ends early (an exception in a layer, a
``KeyboardInterrupt``, ``Pipe.close()`` from another thread) therefore cannot
leave results behind for the next call to take. Before a call returns it
cancels its tasks that have not started and waits for those that run::

    caller:  open ──put(i, j)──> ... ──get(j)──> ... ──finish: cancel, wait──> return / raise
    worker:       task of a cancelled call: skipped; else computed, reported to *its* call

:class:`CallLock` serialises the calls of one ``Pipe`` made from several
threads, and survives ``fork``: a child process gets a fresh lock, as threads
(and the lock's holder) do not survive ``fork``.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from types import TracebackType
from typing import Any, Optional, Union

__all__: list[str] = []

logger = logging.getLogger(__name__)

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
# (True, (task, output batch)) or (False, exc_info of the layer's exception)
Result = tuple[bool, Any]


class PipeClosedError(RuntimeError):
    """``Pipe.close()`` ended the workers while a call was using them."""


class _Aborted:
    """Put in a call's result queues to wake a caller whose call was aborted."""


_ABORTED = _Aborted()


class Call:
    """One forward of a pipeline: its result queues, its pending tasks, whether it was cancelled.

    Args:
        partitions: number of partitions (one result queue each).
    """

    def __init__(self, partitions: int) -> None:
        self.results: list[queue.Queue[Union[Result, _Aborted]]] = [queue.Queue() for _ in range(partitions)]
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._cancelled = False
        self._abort: Optional[BaseException] = None

    @property
    def cancelled(self) -> bool:
        """Whether tasks of this call that have not started should be skipped."""
        return self._cancelled

    def handed(self) -> None:
        """Counts a task handed to a worker; the worker calls :meth:`done` for it."""
        with self._lock:
            self._pending += 1

    def done(self, j: int, result: Optional[Result]) -> None:
        """A worker finished (result) or skipped (None) a task of partition j."""
        if result is not None:
            self.results[j].put(result)
        with self._lock:
            self._pending -= 1
            self._idle.notify_all()

    def get(self, j: int) -> Result:
        """The next result of partition j.

        Raises:
            PipeClosedError: the call was aborted (the workers were closed).
        """
        item = self.results[j].get()
        if isinstance(item, _Aborted):
            self.results[j].put(item)  # for every later get
        if self._abort is not None:  # set before the marker is put: a result that came with it is dropped
            raise self._abort
        assert not isinstance(item, _Aborted)
        return item

    def abort(self, error: BaseException) -> None:
        """Cancels the call and makes every :meth:`get` raise ``error`` (from another thread)."""
        with self._lock:
            self._cancelled = True
            self._abort = error
            self._idle.notify_all()
        for results in self.results:
            results.put(_ABORTED)

    def finish(self) -> None:
        """Cancels the tasks that have not started and waits for those that run.

        Called when the call ends, normally or not, so that no task of it runs
        (or reports) once the call has returned. A call aborted by
        :meth:`abort` does not wait: its workers are being closed.
        """
        with self._lock:
            self._cancelled = True
            while self._pending and self._abort is None:
                # A timeout keeps the wait interruptible and logs a worker stuck in a layer.
                if not self._idle.wait(timeout=30.0):
                    logger.warning("a pipeline call waits for %d task(s) still running in its workers",
                                   self._pending)


class CallLock:
    """Serialises the calls of one ``Pipe``; a process forked while it was held gets a free one.

    Usage::

        with self._call_lock:
            ...  # one call at a time, from any number of threads

    Copies (``copy.deepcopy``, pickling) get a fresh lock.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _current(self) -> threading.Lock:
        if self._pid != os.getpid():
            # Forked: the thread that held the lock, if any, does not exist here.
            self._pid = os.getpid()
            self._lock = threading.Lock()
        return self._lock

    def __enter__(self) -> None:
        self._current().acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple[type["CallLock"], tuple[()]]:
        return CallLock, ()
