"""The backward pass of the worker backward: the jobs of one forward's cells, their placeholders, the end.

:mod:`pipe.threads.worker_backward` cuts each CPU cell out of the caller's
graph and hands its backward, as a job, to the cell's worker. This module
keeps the books of one such backward: which placeholder gradient each job
fills and when it is ready (:class:`Ready`), which workers hold its jobs, the
first failure, and a callback on autograd's engine that makes ``backward()``
return only when every job is done (or, interrupted, cancels the jobs that
have not started and waits for those that run). Waiting follows each
worker's queue (:class:`pipe.threads.call.Drain`), not a count kept around
the hand-overs, which an interrupt could leave wrong.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from pipe.threads.call import Drain

__all__: list[str] = []


class Ready:
    """Set when a job has filled its placeholders (or failed).

    A latch made of one C lock, held until :meth:`set`: waiting is one
    interruptible call into C, so an interrupt in the caller's thread leaves no
    lock of a :class:`threading.Event` held for the worker that sets it.
    """

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self._latch.acquire()
        self.failure: Optional[BaseException] = None

    def set(self, failure: Optional[BaseException] = None) -> None:
        self.failure = failure
        self._latch.release()

    def wait(self) -> None:
        with self._latch:  # acquired once set, released at once for the next waiter
            pass
        if self.failure is not None:
            raise UpstreamFailed() from self.failure


class UpstreamFailed(Exception):
    """A job whose gradient came from a failed job: not a failure of its own."""


class Cancelled(UpstreamFailed):
    """A job of a backward that was interrupted: it does not run."""


class BackwardPass:
    """The backward jobs of the cells of one forward pass.

    Args:
        submit: hands a job to partition j's worker: ``submit(j, job)``.
        sync_first: the pipeline's inputs require grad, so the first
            partition's gradients leave the pipeline and must be real when
            autograd receives them (its jobs are waited for in backward).
    """

    def __init__(self, submit: Callable[[int, Callable[[], None]], None], sync_first: bool = False) -> None:
        self._submit = submit
        self.sync_first = sync_first
        self._lock = threading.Lock()  # held only for bookkeeping, never across a wait
        self._workers: set[int] = set()  # the workers handed a job since the last wait
        self._drain = Drain("a cancelled backward")
        self._failure: Optional[BaseException] = None
        self._waiting = False
        self._cancelled = False
        # id(placeholder) -> (placeholder, its readiness); the tensor is kept so the id stays unique.
        self._placeholders: dict[int, tuple[Tensor, Ready]] = {}

    def readiness(self, grad: Optional[Tensor]) -> Optional[Ready]:
        """The readiness of ``grad`` if it is a placeholder of this pass, else None.

        A placeholder has one consumer, so it is forgotten here: the pass does
        not keep gradients alive after the job that reads them.
        """
        if grad is None:
            return None
        with self._lock:
            entry = self._placeholders.get(id(grad))
            if entry is None or entry[0] is not grad:
                return None
            del self._placeholders[id(grad)]
        return entry[1]

    def placeholders(self, like: Sequence[Optional[Tensor]], ready: Ready) -> list[Optional[Tensor]]:
        """Uninitialised gradients shaped like ``like`` (None stays None), filled when ``ready`` is set."""
        out: list[Optional[Tensor]] = []
        with self._lock:
            for tensor in like:
                if tensor is None:
                    out.append(None)
                    continue
                placeholder = torch.empty_like(tensor)
                self._placeholders[id(placeholder)] = (placeholder, ready)
                out.append(placeholder)
        return out

    @property
    def cancelled(self) -> bool:
        """Whether the backward was interrupted: jobs that have not started do not run."""
        return self._cancelled

    def submit(self, j: int, job: Callable[[], None]) -> None:
        """Runs ``job`` on worker j and makes ``backward()`` wait for it."""
        with self._lock:
            if not self._waiting:
                # At the end of this backward, wait for every job: the caller
                # must not see gradients that are still being written.
                self._waiting = True
                self._cancelled = False
                torch.autograd.Variable._execution_engine.queue_callback(_EndOfBackward(self))

        def run() -> None:
            try:
                job()
            except UpstreamFailed:
                pass
            except BaseException as error:  # reaches the caller through wait()
                with self._lock:
                    if self._failure is None:
                        self._failure = error

        # Noted before the hand-over: interrupted in between, the wait hands worker j a marker it need not.
        self._workers.add(j)
        self._submit(j, run)

    def wait(self) -> None:
        """Blocks until every submitted job is done; raises the first failure.

        Interrupted (``KeyboardInterrupt``), it cancels the jobs that have not
        started and waits for those that run before it raises.
        """
        try:
            self._drain.wait(self._submit, self._workers, warn=False)  # a long backward is no stuck layer
        except BaseException:
            self.cancel()
            raise
        with self._lock:
            failure, self._failure = self._failure, None
        self._end()
        if failure is not None:
            raise failure

    def cancel(self) -> None:
        """Stops the backward: jobs that have not started do not run; waits for those that run."""
        self._cancelled = True
        self._drain.wait(self._submit, self._workers)
        with self._lock:
            self._failure = None
        self._end()

    def _end(self) -> None:
        with self._lock:
            self._workers.clear()
            self._placeholders.clear()
            self._waiting = False


class _EndOfBackward:
    """The callback queued on autograd's engine: at the end of backward, waits for the pass's jobs.

    An exception raised elsewhere in the caller's graph (an interrupt that
    lands in another node, a failing hook) ends autograd's backward without
    running its callbacks, and the jobs would go on writing gradients after
    ``backward()`` raised. Autograd then drops this callback unrun, while the
    exception propagates: that cancels the pass and waits for its running jobs.
    """

    def __init__(self, backward_pass: BackwardPass) -> None:
        self.backward_pass = backward_pass
        self.ran = [False]
        weakref.finalize(self, _dropped, backward_pass, self.ran)

    def __call__(self) -> None:
        self.ran[0] = True
        self.backward_pass.wait()


def _dropped(backward_pass: BackwardPass, ran: list[bool]) -> None:
    if not ran[0]:
        backward_pass.cancel()
