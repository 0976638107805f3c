"""Workers: one persistent thread per partition that runs its tasks.

Partitions run concurrently because each has its own thread, also when
several share a device (two CPU partitions use two cores). Threads start on
first use, live as long as the :class:`Workers` object and end when it is
closed or collected; they hold no reference to it, so dropping the owning
``Pipe`` is enough to end them.

Grad mode, inference mode and autocast are thread-local in PyTorch, so a task
captures the caller's state and the worker runs it under the same
(:mod:`pipe.core.threadstate`).

A task belongs to a call (:mod:`pipe.threads.call`) and reports to that call's
queues; a task of a call that was cancelled is skipped. Threads do not survive
``fork``: in a child process the workers start anew on first use.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import weakref
from types import TracebackType
from typing import Any, Callable, Optional, Union

import torch

from pipe.core.microbatch import Batch
from pipe.core.stream import AbstractStream, use_device, use_stream
from pipe.core.threadstate import ThreadState
from pipe.threads.call import Call, PipeClosedError

__all__: list[str] = []

logger = logging.getLogger(__name__)

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
# What a worker's queue holds: a task, a job that reports by itself, or None (stop).
Item = Union["Task", Callable[[], None], None]


class Task:
    """A unit of work for a worker: ``compute`` in the worker, ``finalize`` in the caller.

    Args:
        stream: the stream to compute on.
        compute: produces the output batch.
        finalize: optional, run by the caller on the output (e.g. wiring recomputation).
        call: the call the task belongs to; its result goes to the call's queues.
        tag: what the task is, for error messages and traces.
    """

    def __init__(
        self,
        stream: AbstractStream,
        *,
        compute: Callable[[], Batch],
        finalize: Optional[Callable[[Batch], None]] = None,
        call: Call,
        tag: tuple[int, int] = (0, 0),
    ) -> None:
        self.stream = stream
        self.call = call
        self._compute = compute
        self._finalize = finalize
        self.tag = tag
        self._state = ThreadState.capture()  # the caller's grad mode, inference mode, autocast

    def compute(self) -> Batch:
        with use_stream(self.stream), self._state.restore():
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream), self._state.restore():
            self._finalize(batch)


def _worker(j: int, in_queue: "queue.SimpleQueue[Item]", device: torch.device,
            cpu_threads: Optional[int]) -> None:
    if device.type == "cpu" and cpu_threads is not None:
        # Intra-op parallelism is per thread (OpenMP), so this bounds this worker only.
        torch.set_num_threads(cpu_threads)
    with use_device(device):
        while True:
            item = in_queue.get()
            if item is None:
                break
            _run(j, item)
            # Nothing of a finished task may stay on this thread's stack while it
            # waits: a task can hold its pipeline's Workers, whose collection is
            # what ends this thread.
            del item


def _run(j: int, item: Union[Task, Callable[[], None]]) -> None:
    if not isinstance(item, Task):
        item()  # a job that reports by itself (pipe.threads.worker_backward, a Drain's marker)
        return
    call = item.call
    if call.cancelled:  # its call ended (an error, an interrupt, close()): nobody waits for it
        return
    try:
        batch = item.compute()
    except BaseException:
        exc_info: Any = sys.exc_info()
        call.done(j, (False, exc_info))
        return
    call.done(j, (True, (item, batch)))


def _stop(in_queues: list["queue.SimpleQueue[Item]"], threads: list[threading.Thread]) -> None:
    for in_queue in in_queues:
        in_queue.put(None)
    # Join, so that no worker is still inside PyTorch when the interpreter
    # tears down at exit (that aborts the process with std::terminate).
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=10)


def partition_threads(cpu_threads: Optional[int], cpu_partitions: int) -> Optional[int]:
    """The intra-op threads of each CPU partition's worker: ``cpu_threads``, else this process's threads
    divided among ``cpu_partitions`` partitions when there are several (None: one partition keeps them)."""
    if cpu_threads is None and cpu_partitions > 1:
        return max(1, torch.get_num_threads() // cpu_partitions)
    return cpu_threads


class Workers:
    """The worker threads of a pipeline, one per partition.

    Args:
        devices: the device of each partition.
        cpu_threads: intra-op threads of each CPU worker (None: PyTorch's setting).
    """

    def __init__(self, devices: list[torch.device], cpu_threads: Optional[int] = None) -> None:
        self.devices = devices
        self.cpu_threads = cpu_threads
        # SimpleQueue: its put is one call into C, which an interrupt in the caller cannot leave half done.
        self.in_queues: list[queue.SimpleQueue[Item]] = []
        self.threads: list[threading.Thread] = []
        self._finalizer: Optional[weakref.finalize] = None
        # Calls under way, aborted by close(); the pid that started the threads.
        self._calls: set[Call] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a child process: the threads, queues and locks of the parent are gone or unusable."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = None
        self.threads = []
        self.in_queues = []
        self._calls = set()
        logger.debug("pipeline workers restart in forked process %d", self._pid)

    def start(self) -> None:
        """Starts the threads if they are not running (also in a process forked after they started)."""
        self._forked()
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self.threads:
            return
        self.in_queues = [queue.SimpleQueue() for _ in self.devices]
        for j, device in enumerate(self.devices):
            thread = threading.Thread(
                target=_worker,
                args=(j, self.in_queues[j], device, self.cpu_threads),
                name=f"pipe-worker-{j}-{device}",
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop, self.in_queues, list(self.threads))
        logger.debug("started %d pipeline workers on %s", len(self.threads), self.devices)

    def open_call(self) -> Call:
        """A new call; :meth:`close` aborts it until :meth:`end_call`."""
        self._forked()
        call = Call(len(self.devices))
        with self._lock:
            self._calls.add(call)
        return call

    def end_call(self, call: Call) -> None:
        """Ends ``call``: cancels its tasks that have not started and waits for those that run."""
        try:
            call.finish(self.submit)
        finally:
            with self._lock:
                self._calls.discard(call)

    def put(self, j: int, task: Task) -> None:
        """Hands ``task`` to worker j; its result goes to ``task.call``."""
        self._forked()
        with self._lock:
            self._start()
            task.call.handed(j)
            self.in_queues[j].put(task)

    def submit(self, j: int, job: Callable[[], None]) -> None:
        """Runs ``job`` on worker j; it reports its result by itself and must not raise."""
        self._forked()
        with self._lock:
            self._start()
            self.in_queues[j].put(job)

    def close(self, timeout: Optional[float] = None) -> None:
        """Ends the threads and waits for them.

        A call under way (a forward in another thread) fails at once with
        :class:`~pipe.threads.call.PipeClosedError`; a later call starts new threads.
        """
        self._forked()
        with self._lock:
            calls, self._calls = self._calls, set()
            finalizer, self._finalizer = self._finalizer, None
            threads, self.threads = self.threads, []
        for call in calls:
            call.abort(PipeClosedError(
                "Pipe.close() was called while this forward ran (from another thread); the forward was "
                "cancelled. Close a Pipe only when no thread is using it"))
        # Tasks queued before the stop marker still reach a worker: those of an aborted call are skipped.
        if finalizer is not None:
            finalizer()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
