"""Worker backward: run each cell's backward on its partition's thread, so CPU partitions overlap in backward too.

PyTorch's autograd engine runs every CPU node on the thread that called
``backward()``. CUDA devices get one autograd thread each, so partitions on
different GPUs overlap in backward by themselves; partitions on the CPU would
take turns, and half of a training step would not be pipelined.

For a pipeline of CPU partitions, each cell (micro-batch i, partition j) is
therefore cut out of the caller's graph: it runs on a detached copy of its
input, and a :class:`Boundary` node stands for it in the caller's graph::

    caller's graph:  x ──Boundary(i, j)──> y ──> ... ──> loss
                          │ backward: hand the job to worker j, return at once
    worker j:        x' ──partition j (its own graph, Checkpoint/Recompute inside)──> y'

When autograd reaches ``Boundary(i, j)`` it hands "back-propagate ``y'`` with
this gradient" to worker j and returns at once, giving the previous partition
a *placeholder* gradient that worker j fills when it is done. Worker j-1 waits
for that placeholder before it runs micro-batch i's backward, and meanwhile
recomputes micro-batch i (a checkpointed cell needs no gradient for that), so
recomputation precedes the gradient's arrival as in GPipe. Placeholders only
pass through nodes that hand gradients on unchanged (fork/join), never through
arithmetic. A callback queued on the autograd engine makes ``backward()``
return only when every job is done, and re-raises the first failure.

Each worker uses its own intra-op threads (``Pipe(cpu_threads=...)``) for its
backward, as for its forward.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from pipe.core.microbatch import Batch
from pipe.core.phony import get_phony
from pipe.core.threadstate import ThreadState

__all__ = ["BackwardPass", "Boundary", "CellBackward"]

logger = logging.getLogger(__name__)


class _Ready:
    """Set when a job has filled its placeholders (or failed)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.failure: Optional[BaseException] = None

    def set(self, failure: Optional[BaseException] = None) -> None:
        self.failure = failure
        self.event.set()

    def wait(self) -> None:
        self.event.wait()
        if self.failure is not None:
            raise _UpstreamFailed() from self.failure


class _UpstreamFailed(Exception):
    """A job whose gradient came from a failed job: not a failure of its own."""


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
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._failure: Optional[BaseException] = None
        self._waiting = False
        # id(placeholder) -> (placeholder, its readiness); the tensor is kept so the id stays unique.
        self._placeholders: dict[int, tuple[Tensor, _Ready]] = {}

    def readiness(self, grad: Optional[Tensor]) -> Optional[_Ready]:
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

    def placeholders(self, like: Sequence[Optional[Tensor]], ready: _Ready) -> list[Optional[Tensor]]:
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

    def submit(self, j: int, job: Callable[[], None]) -> None:
        """Runs ``job`` on worker j and makes ``backward()`` wait for it."""
        with self._lock:
            self._pending += 1
            if not self._waiting:
                # At the end of this backward, wait for every job: the caller
                # must not see gradients that are still being written.
                self._waiting = True
                torch.autograd.Variable._execution_engine.queue_callback(self.wait)

        def run() -> None:
            failure: Optional[BaseException] = None
            try:
                job()
            except _UpstreamFailed:
                pass
            except BaseException as error:  # reaches the caller through wait()
                failure = error
            with self._lock:
                if failure is not None and self._failure is None:
                    self._failure = failure
                self._pending -= 1
                self._idle.notify_all()

        self._submit(j, run)

    def wait(self) -> None:
        """Blocks until every submitted job is done; raises the first failure."""
        with self._lock:
            while self._pending:
                self._idle.wait()
            failure, self._failure = self._failure, None
            self._placeholders.clear()
            self._waiting = False
        if failure is not None:
            raise failure


class CellBackward:
    """One cell cut out of the caller's graph: its detached input and its output.

    Args:
        backward_pass: the pass the cell's job belongs to.
        j: the partition, whose worker runs the job.
        inner_input: the detached input the partition ran on.
        prepare: optional work that needs no gradient, done first (recomputation).
        sync: wait for the job before returning from backward (for a cell whose
            input gradient leaves the pipeline: it must be real, not a placeholder).
    """

    def __init__(self, backward_pass: BackwardPass, j: int, inner_input: Batch,
                 prepare: Optional[Callable[[], None]] = None, sync: bool = False) -> None:
        self.backward_pass = backward_pass
        self.j = j
        self.inner_input = inner_input
        self.inner_output: Optional[Batch] = None
        self.prepare = prepare
        self.sync = sync

    def connect(self, outer_input: Batch, inner_output: Batch) -> Batch:
        """The output as the caller's graph sees it: hanging off ``outer_input`` through a Boundary."""
        self.inner_output = inner_output
        phony = get_phony(self.inner_input.device if self.inner_input.tensors else torch.device("cpu"),
                          requires_grad=True)
        outer = Boundary.apply(phony, self, *outer_input.tensors)
        return inner_output.with_tensors(list(outer))

    def run(self, grads: Sequence[Optional[Tensor]], readies: Sequence[Optional[_Ready]],
            placeholders: Sequence[Optional[Tensor]], done: _Ready) -> None:
        """The job: prepare, wait for the gradients, back-propagate, fill the placeholders."""
        try:
            if self.prepare is not None:
                self.prepare()
            for ready in readies:
                if ready is not None:
                    ready.wait()
            assert self.inner_output is not None  # set by connect()
            outputs = self.inner_output.tensors
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            for x, placeholder in zip(self.inner_input.tensors, placeholders):
                if placeholder is None:
                    continue
                if x.grad is None:
                    placeholder.zero_()
                else:
                    placeholder.copy_(x.grad)
        except BaseException as error:
            done.set(error)
            raise
        finally:
            # The cell's graph and activations are not needed any more.
            self.inner_output = None
            self.prepare = None
        done.set()


class Boundary(torch.autograd.Function):
    """Stands for a cell in the caller's graph; its backward hands the cell's backward to a worker."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, cell: CellBackward, *outer_input: Tensor) -> tuple[Tensor, ...]:
        ctx.cell = cell
        ctx.input_needs_grad = [x.requires_grad for x in outer_input]
        assert cell.inner_output is not None  # set by connect()
        tensors = cell.inner_output.tensors
        ctx.mark_non_differentiable(*[t for t in tensors if not (t.is_floating_point() or t.is_complex())])
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        cell: CellBackward = ctx.cell
        backward_pass = cell.backward_pass
        readies = [backward_pass.readiness(g) for g in grads]
        done = _Ready()
        like = [x if needs else None for x, needs in zip(cell.inner_input.tensors, ctx.input_needs_grad)]
        placeholders = backward_pass.placeholders(like, done)
        state = ThreadState.capture()  # what autograd's thread runs under, for the worker (pipe.core.threadstate)

        def job() -> None:
            with state.restore():
                cell.run(grads, readies, placeholders, done)

        backward_pass.submit(cell.j, job)
        if cell.sync:
            try:
                done.wait()
            except _UpstreamFailed:
                pass  # the failure itself is raised by BackwardPass.wait at the end
        return (None, None) + tuple(placeholders)
