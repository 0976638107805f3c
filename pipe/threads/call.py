"""Calls: the identity of one use of a pipeline, so that its work is told apart, cancelled and waited for.

Every task a forward hands to the workers belongs to a :class:`Call`, and a
worker reports the task's result to that call's own queues, never to a queue
shared between calls. A call that ends early (an exception in a layer, a
``KeyboardInterrupt``, ``Pipe.close()`` from another thread) therefore cannot
leave results behind for the next call to take. Before a call returns it
cancels its tasks that have not started and waits for those that run::

    caller:  open ──put(i, j)──> ... ──get(j)──> ... ──finish: cancel, drain──> return / raise
    worker:       task of a cancelled call: skipped; else computed, reported to *its* call

A ``KeyboardInterrupt`` is raised in the caller between any two bytecodes, so
nothing the caller waits on may depend on bookkeeping it does around handing
work over (a count raised just before an interrupted hand-over is never
lowered, and the wait hangs). The caller therefore waits with a
:class:`Drain`: a worker takes its queue in order, so a marker handed to it
after a call's tasks is reached once they are done. The queues are
:class:`queue.SimpleQueue`, whose ``put`` and ``get`` are single calls into C
that an interrupt cannot leave half done.

:class:`CallLock` serialises the calls of one ``Pipe`` made from several
threads, and survives ``fork``: a child process gets a fresh lock, as threads
(and the lock's holder) do not survive ``fork``.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from types import TracebackType
from typing import Any, Callable, Iterable, Optional, Union

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


class Drain:
    """Waits, in the caller's thread, until workers have run everything handed to them so far.

    Each wait hands every worker it names a marker of its own and returns when
    all of them are reached; markers of an earlier, interrupted wait are
    ignored. :meth:`wake` ends a wait from another thread.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._reached: queue.SimpleQueue[Optional[object]] = queue.SimpleQueue()

    def wait(self, submit: Callable[[int, Callable[[], None]], None], workers: Iterable[int],
             warn: bool = True) -> bool:
        """Hands worker j a marker (``submit(j, marker)``) for each j in ``workers`` and waits for them all;
        with ``warn``, logs a warning every 30 s while workers still run (a layer stuck after a cancel).

        Returns False if :meth:`wake` ended the wait first.
        """
        token = object()
        left = 0
        for j in sorted(set(workers)):
            submit(j, functools.partial(self._reached.put, token))
            left += 1
        while left:
            try:
                # A timeout only to log a worker stuck in a layer; the get itself is interruptible.
                item = self._reached.get(timeout=30.0 if warn else None)
            except queue.Empty:
                logger.warning("%s waits for %d worker(s) still running its work", self.what, left)
                continue
            if item is None:
                return False
            if item is token:
                left -= 1
        return True

    def wake(self) -> None:
        """Ends the wait under way, or the next one, at once (from another thread)."""
        self._reached.put(None)


class Call:
    """One forward of a pipeline: its result queues, the workers it handed tasks to, whether it was cancelled.

    Args:
        partitions: number of partitions (one result queue each).
    """

    def __init__(self, partitions: int) -> None:
        self.results: list[queue.SimpleQueue[Union[Result, _Aborted]]] = [
            queue.SimpleQueue() for _ in range(partitions)]
        self._workers: set[int] = set()
        self._drain = Drain("a pipeline call")
        self._cancelled = False
        self._abort: Optional[BaseException] = None

    @property
    def cancelled(self) -> bool:
        """Whether tasks of this call that have not started should be skipped."""
        return self._cancelled

    def handed(self, j: int) -> None:
        """Notes that a task is about to be handed to worker j (in the caller's thread)."""
        self._workers.add(j)

    def done(self, j: int, result: Result) -> None:
        """A worker of partition j finished a task of this call."""
        self.results[j].put(result)

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
        self._cancelled = True
        self._abort = error
        self._drain.wake()
        for results in self.results:
            results.put(_ABORTED)

    def finish(self, submit: Callable[[int, Callable[[], None]], None]) -> None:
        """Cancels the tasks that have not started and waits for those that run (``submit`` hands a worker a
        job, as :meth:`pipe.threads.worker.Workers.submit`).

        Called when the call ends, normally or not, so that no task of it runs
        (or reports) once the call has returned. A call aborted by
        :meth:`abort` does not wait: its workers are being closed.
        """
        self._cancelled = True
        if self._abort is None:
            self._drain.wait(submit, self._workers)


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
