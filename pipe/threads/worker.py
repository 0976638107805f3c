"""Workers: one persistent thread per partition that runs its tasks.

Partitions run concurrently because each has its own thread, also when
several share a device (two CPU partitions use two cores). Threads start on
first use, live as long as the :class:`Workers` object and end when it is
closed or collected; they hold no reference to it, so dropping the owning
``Pipe`` is enough to end them.

Grad mode, inference mode and autocast are thread-local in PyTorch, so a task
captures the caller's state and the worker runs it under the same
(:mod:`pipe.core.threadstate`).
"""
from __future__ import annotations

import logging
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

__all__ = ["Task", "Workers"]

logger = logging.getLogger(__name__)

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
Result = Union[tuple[bool, tuple["Task", Batch]], tuple[bool, ExcInfo]]


class Task:
    """A unit of work for a worker: ``compute`` in the worker, ``finalize`` in the caller.

    Args:
        stream: the stream to compute on.
        compute: produces the output batch.
        finalize: optional, run by the caller on the output (e.g. wiring recomputation).
        tag: what the task is, for error messages and traces.
    """

    def __init__(
        self,
        stream: AbstractStream,
        *,
        compute: Callable[[], Batch],
        finalize: Optional[Callable[[Batch], None]] = None,
        tag: tuple[int, int] = (0, 0),
    ) -> None:
        self.stream = stream
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


def _worker(in_queue: "queue.Queue[Optional[Task]]", out_queue: "queue.Queue[Result]", device: torch.device,
            cpu_threads: Optional[int]) -> None:
    if device.type == "cpu" and cpu_threads is not None:
        # Intra-op parallelism is per thread (OpenMP), so this bounds this worker only.
        torch.set_num_threads(cpu_threads)
    with use_device(device):
        while True:
            item = in_queue.get()
            if item is None:
                break
            _run(item, out_queue)
            # Nothing of a finished task may stay on this thread's stack while it
            # waits: a task can hold its pipeline's Workers, whose collection is
            # what ends this thread.
            del item


def _run(item: Union[Task, Callable[[], None]], out_queue: "queue.Queue[Result]") -> None:
    if not isinstance(item, Task):
        item()  # a job that reports by itself (pipe.threads.worker_backward)
        return
    try:
        batch = item.compute()
    except BaseException:
        exc_info: Any = sys.exc_info()
        out_queue.put((False, exc_info))
        return
    out_queue.put((True, (item, batch)))


def _stop(in_queues: list["queue.Queue[Optional[Task]]"], threads: list[threading.Thread]) -> None:
    for in_queue in in_queues:
        in_queue.put(None)
    # Join, so that no worker is still inside PyTorch when the interpreter
    # tears down at exit (that aborts the process with std::terminate).
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=10)


class Workers:
    """The worker threads of a pipeline, one per partition.

    Args:
        devices: the device of each partition.
        cpu_threads: intra-op threads of each CPU worker (None: PyTorch's setting).
    """

    def __init__(self, devices: list[torch.device], cpu_threads: Optional[int] = None) -> None:
        self.devices = devices
        self.cpu_threads = cpu_threads
        self.in_queues: list[queue.Queue[Optional[Task]]] = []
        self.out_queues: list[queue.Queue[Result]] = []
        self.threads: list[threading.Thread] = []
        self._finalizer: Optional[weakref.finalize] = None

    def start(self) -> None:
        """Starts the threads if they are not running."""
        if self.threads:
            return
        self.in_queues = [queue.Queue() for _ in self.devices]
        self.out_queues = [queue.Queue() for _ in self.devices]
        for j, device in enumerate(self.devices):
            thread = threading.Thread(
                target=_worker,
                args=(self.in_queues[j], self.out_queues[j], device, self.cpu_threads),
                name=f"pipe-worker-{j}-{device}",
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop, self.in_queues, list(self.threads))
        logger.debug("started %d pipeline workers on %s", len(self.threads), self.devices)

    def put(self, j: int, task: Task) -> None:
        self.start()
        self.in_queues[j].put(task)

    def submit(self, j: int, job: Callable[[], None]) -> None:
        """Runs ``job`` on worker j; it reports its result by itself and must not raise."""
        self.start()
        self.in_queues[j].put(job)  # type: ignore[arg-type]

    def get(self, j: int) -> Result:
        return self.out_queues[j].get()

    def close(self, timeout: Optional[float] = None) -> None:
        """Ends the threads and waits for them."""
        if self._finalizer is not None:
            self._finalizer()
        for thread in self.threads:
            thread.join(timeout)
        self.threads = []
        self._finalizer = None
