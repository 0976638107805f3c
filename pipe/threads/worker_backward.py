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
return only when every job is done, and re-raises the first failure: the
books of one backward's jobs are :mod:`pipe.threads.backward_pass`; this
module is the cell's side (:class:`CellBackward`, :class:`Boundary`).

Each worker uses its own intra-op threads (``Pipe(cpu_threads=...)``) for its
backward, as for its forward.

What autograd's own backward guarantees holds here too:

- ``torch.autograd.grad(...)`` and ``backward(inputs=...)`` fill only what
  they ask for: the partition's parameters are inputs of its ``Boundary``, so
  the engine says which of them it wants, and the cell's gradients are then
  computed on the caller's thread for exactly those (no ``.grad`` filled as a
  side effect).
- ``retain_graph=True``: a cell keeps its graph until the caller's graph lets
  go of its ``Boundary`` (a saved token tells), so a second backward works.
- ``create_graph=True`` (double backward, a gradient penalty) cannot cross the
  cut, and raises at once with the fix.
- An interrupted backward (``KeyboardInterrupt``, or any exception in another
  node of the caller's graph) cancels the jobs that have not started and waits
  for those that run before it leaves ``backward()``, so no job writes a
  gradient after it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from pipe.core.checkpoint import Checkpointing
from pipe.core.microbatch import Batch
from pipe.core.phony import get_phony
from pipe.core.threadstate import ThreadState
from pipe.threads.backward_pass import BackwardPass, Cancelled, Ready, UpstreamFailed

__all__: list[str] = []

_DOUBLE_BACKWARD = (
    "create_graph=True (double backward, e.g. a gradient penalty) is not supported by a Pipe whose partitions "
    "all run on the CPU: each partition back-propagates on its worker thread, and the graph of the gradient "
    "cannot cross partitions; set pipe.worker_backward = False and checkpoint='never' for autograd's own "
    "backward, which supports it"
)


def _keep(tensor: Tensor) -> Tensor:
    return tensor


class CellBackward:
    """One cell cut out of the caller's graph: its detached input and its output.

    Args:
        backward_pass: the pass the cell's job belongs to.
        j: the partition, whose worker runs the job.
        inner_input: the detached input the partition ran on.
        prepare: optional work that needs no gradient, done first (recomputation).
        sync: wait for the job before returning from backward (for a cell whose
            input gradient leaves the pipeline: it must be real, not a placeholder).
        record: the cell's checkpoint record when it is checkpointed (``prepare``
            then fills its recomputed graph).
    """

    def __init__(self, backward_pass: BackwardPass, j: int, inner_input: Batch,
                 prepare: Optional[Callable[[], None]] = None, sync: bool = False,
                 record: Optional[Checkpointing] = None) -> None:
        self.backward_pass = backward_pass
        self.j = j
        self.inner_input = inner_input
        self.inner_output: Optional[Batch] = None
        self.prepare = prepare
        self.sync = sync
        self.record = record
        self.params: list[Tensor] = []
        self.param_nodes: list[Any] = []

    def connect(self, outer_input: Batch, inner_output: Batch, params: Sequence[Tensor] = ()) -> Batch:
        """The output as the caller's graph sees it: hanging off ``outer_input`` through a Boundary.

        ``params`` (the partition's parameters that require grad) are inputs of
        the Boundary too, so that ``torch.autograd.grad`` can ask for them.
        """
        self.inner_output = inner_output
        self.params = list(params)
        # Through a view each, whose node the engine can be asked about (a leaf's cannot under grad()).
        views = [p.view_as(p) for p in self.params]
        self.param_nodes = [v.grad_fn for v in views]
        phony = get_phony(self.inner_input.device if self.inner_input.tensors else torch.device("cpu"),
                          requires_grad=True)
        # The Boundary saves only its token, which the caller's saved-tensor hooks (save_on_cpu, ...) must
        # neither see nor copy (autograd packs saved tensors when apply() returns, so the hooks go around it).
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            outer = Boundary.apply(phony, self, *outer_input.tensors, *views)
        return inner_output.with_tensors(list(outer))

    def release(self) -> None:
        """The caller's graph let go of the cell: its graph and activations are not needed any more."""
        self.inner_output = None
        self.prepare = None
        self.record = None

    def _graph(self) -> tuple[list[Tensor], list[Tensor]]:
        """The cell's outputs and inputs, joined by a graph with grad (recomputed for a checkpointed cell)."""
        inner_output = self.inner_output
        if inner_output is None:
            raise RuntimeError(
                "Trying to backward through the pipeline's graph a second time (or after it was freed); "
                "specify retain_graph=True on the first backward to backward twice"
            )
        if self.record is not None and self.prepare is not None:
            self.prepare()  # replays the cell with grad into record.recomputed
            return self.record.recomputed.pop()
        return inner_output.tensors, self.inner_input.tensors

    def grads_here(self, grads: Sequence[Optional[Tensor]], input_needs_grad: Sequence[bool],
                   wanted_params: Sequence[bool]) -> tuple[Optional[Tensor], ...]:
        """For ``torch.autograd.grad`` / ``backward(inputs=...)``: the gradients it asks for, on this thread.

        Nothing is accumulated into ``.grad``: the engine receives the
        gradients of the cell's inputs and of the wanted parameters.
        """
        outputs, inputs = self._graph()
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        targets = [x for x, needs in zip(inputs, input_needs_grad) if needs]
        targets += [p for p, wanted in zip(self.params, wanted_params) if wanted]
        found: list[Optional[Tensor]] = [None] * len(targets)
        if pairs and targets:
            found = list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                             retain_graph=True, allow_unused=True))
        out: list[Optional[Tensor]] = []
        for needs in list(input_needs_grad) + list(wanted_params):
            out.append(found.pop(0) if needs else None)
        return tuple(out)

    def job(self, grads: Sequence[Optional[Tensor]], readies: Sequence[Optional[Ready]],
            placeholders: Sequence[Optional[Tensor]], done: Ready) -> Callable[[], None]:
        """The job for the worker, holding the cell's graph: release() may drop the cell's own reference
        as soon as the Boundary's backward returns."""
        held = [(self.inner_output, self.prepare)]

        state = ThreadState.capture()  # what autograd's thread runs under, for the worker (pipe.core.threadstate)

        def job() -> None:
            # Taken out, so that the graph goes with this frame, before the pass counts the job done.
            inner_output, prepare = held.pop()
            with state.restore():
                self.run(grads, readies, placeholders, done, inner_output, prepare)

        return job

    def run(self, grads: Sequence[Optional[Tensor]], readies: Sequence[Optional[Ready]],
            placeholders: Sequence[Optional[Tensor]], done: Ready, inner_output: Optional[Batch],
            prepare: Optional[Callable[[], None]]) -> None:
        """The job: prepare, wait for the gradients, back-propagate, fill the placeholders."""
        try:
            if self.backward_pass.cancelled:
                raise Cancelled()
            if prepare is not None:
                prepare()
            for ready in readies:
                if ready is not None:
                    ready.wait()
            if self.backward_pass.cancelled:
                raise Cancelled()
            if inner_output is None:
                raise RuntimeError("Trying to backward through the pipeline's graph a second time (or after it "
                                   "was freed); specify retain_graph=True on the first backward to backward twice")
            outputs = inner_output.tensors
            for x in self.inner_input.tensors:
                x.grad = None  # a second backward (retain_graph=True) starts afresh
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                # The graph stays until the caller's graph lets go of the cell (release()), for retain_graph=True.
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=True)
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
        done.set()


class Boundary(torch.autograd.Function):
    """Stands for a cell in the caller's graph; its backward hands the cell's backward to a worker."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, cell: CellBackward, *outer_input_and_params: Tensor) -> tuple[Tensor, ...]:
        ctx.cell = cell
        outer_input = outer_input_and_params[:len(cell.inner_input.tensors)]
        ctx.input_needs_grad = [x.requires_grad for x in outer_input]
        # A token only the caller's graph holds: when autograd frees it (after a
        # backward without retain_graph=True, or with the graph), the cell lets go of its own.
        token = torch.empty(0)
        ctx.save_for_backward(token)  # past the caller's saved-tensor hooks: see CellBackward.connect
        weakref.finalize(token, cell.release)
        assert cell.inner_output is not None  # set by connect()
        tensors = cell.inner_output.tensors
        outputs = tuple(t.detach() for t in tensors)
        # An output the cell made without a gradient (a table made from buffers) gets none here either.
        ctx.mark_non_differentiable(*[o for o, t in zip(outputs, tensors) if not t.requires_grad])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        ctx.saved_tensors  # raises autograd's own error on a second backward without retain_graph=True
        cell: CellBackward = ctx.cell
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD)
        if not torch.autograd._is_checkpoint_valid():
            # torch.autograd.grad(...) or backward(inputs=...): only what it asks for, nothing into .grad.
            wanted = [bool(torch._C._will_engine_execute_node(node)) for node in cell.param_nodes]
            return (None, None) + cell.grads_here(grads, ctx.input_needs_grad, wanted)
        backward_pass = cell.backward_pass
        readies = [backward_pass.readiness(g) for g in grads]
        done = Ready()
        like = [x if needs else None for x, needs in zip(cell.inner_input.tensors, ctx.input_needs_grad)]
        placeholders = backward_pass.placeholders(like, done)
        # Interrupted from here on, autograd drops the pass's callback unrun, which cancels the pass (_EndOfBackward).
        backward_pass.submit(cell.j, cell.job(grads, readies, placeholders, done))
        if cell.sync:
            try:
                done.wait()
            except UpstreamFailed:
                pass  # the failure itself is raised by BackwardPass.wait at the end
        # The parameters' gradients are accumulated by the workers themselves.
        return (None, None) + tuple(placeholders) + (None,) * len(cell.params)
