"""Checkpointing: drop a partition's activations in forward, recompute them in backward.

torch.utils.checkpoint recomputes inside the backward of one node, so the
recomputation of a micro-batch cannot start until its gradient has arrived.
GPipe wants the opposite: on a device, recomputation of micro-batch i should be
queued before the gradient of i arrives, so that it overlaps with the
backward of the next partition. The work is therefore split in two autograd
functions sharing one :class:`Checkpointing` record::

    forward:   input ──Checkpoint (no_grad forward)──> output ──Join──> ...
                 └────────────Recompute────────────────phony──┘
    backward:  grad ──Join──> Recompute (replays forward with grad, RNG restored)
                        └───> Checkpoint (backward through the recomputed graph)

``Recompute`` hangs off the output through a phony (see
:mod:`pipe.core.dependency`), so autograd reaches it first, and it runs the forward
again with the saved random state; ``Checkpoint`` then back-propagates through
that recomputed graph. The same record serves the thread pipeline and the
per-rank process pipeline.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor

from pipe import trace
from pipe.core.dependency import fork, join
from pipe.core.inplace import InputGuard, own, verify_unmodified, versions_of
from pipe.core.microbatch import Batch
from pipe.core.phony import get_phony
from pipe.core.rng import RNGState, restore_rng_state, save_rng_state
from pipe.core.threadstate import ThreadState

__all__: list[str] = []

Function = Callable[[Batch], Batch]


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


_local = _ThreadLocal()


@contextmanager
def enable_checkpointing() -> Iterator[None]:
    """Marks the body as the checkpointed (no-grad) first forward."""
    orig = _local.is_checkpointing
    _local.is_checkpointing = True
    try:
        yield
    finally:
        _local.is_checkpointing = orig


@contextmanager
def enable_recomputing() -> Iterator[None]:
    """Marks the body as the recomputation in backward."""
    orig = _local.is_recomputing
    _local.is_recomputing = True
    try:
        yield
    finally:
        _local.is_recomputing = orig


def is_checkpointing() -> bool:
    """Whether the current forward is a checkpointed one whose activations are dropped.

    A layer can use it to skip work that only matters once, e.g.::

        if not pipe.is_recomputing():
            self.counter += 1
    """
    return _local.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current forward is the recomputation of a checkpointed one."""
    return _local.is_recomputing


class Checkpointing:
    """One checkpointed (micro-batch, partition) cell.

    Usage::

        chk = Checkpointing(function, batch)
        output = chk.checkpoint()   # forward without keeping activations
        chk.recompute(output)       # wire recomputation ahead of output's backward

    Args:
        function: runs the partition on a batch.
        batch: the input micro-batch.
        tag: (micro-batch, stage) of the cell, for :mod:`pipe.trace`.
        offload: optional factory of a saved-tensor hooks context
            (:meth:`pipe.recompute.Offloader.hooks`): the input kept for
            recomputation then waits in host memory (checkpoint swap).
        guard: the partition's :class:`pipe.core.inplace.InputGuard`, shared by
            its cells, so that a partition modifying its input in place leaves
            the replay's input intact; default: one of the cell's own (which
            copies the input, not knowing the partition).
    """

    def __init__(self, function: Function, batch: Batch, tag: Optional[tuple[int, int]] = None,
                 offload: Optional[Callable[[], ContextManager[Any]]] = None,
                 guard: Optional[InputGuard] = None) -> None:
        self.function = function
        self.batch = batch
        self.tag = tag
        self.offload = offload
        self.guard = guard if guard is not None else InputGuard(f"the cell {tag}")
        self.requires_grad = [t.requires_grad for t in batch.tensors]  # kept copies do not
        # Which outputs the first forward let need a gradient (None: every floating-point one).
        self.differentiable: Optional[tuple[bool, ...]] = None
        self.kept_versions: list[Optional[int]] = []  # of the kept input after the first forward
        self.device = batch.device
        self.rng_state: Optional[RNGState] = None
        self.state: Optional[ThreadState] = None  # the first forward's autocast, replayed
        # Filled by Recompute.backward, consumed by Checkpoint.backward.
        self.recomputed: deque[tuple[list[Tensor], list[Tensor]]] = deque(maxlen=1)
        self._output: Optional[Batch] = None

    def checkpoint(self) -> Batch:
        """Runs the forward under no_grad; the output still requires grad."""
        phony = get_phony(self.device, requires_grad=True)
        self.state = ThreadState.capture()
        tensors = Checkpoint.apply(phony, self, *self.batch.tensors)
        template, self._output = self._output, None
        assert template is not None  # set by Checkpoint.forward
        return template.with_tensors(tensors)

    def replay(self, saved: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Runs the forward again on ``saved`` inputs with grad and the first forward's RNG state.

        Returns:
            ``(outputs, inputs)`` of the recomputed graph, for Checkpoint's backward.
        """
        inputs = [x.detach().requires_grad_(needs) for x, needs in zip(saved, self.requires_grad)]
        assert self.rng_state is not None and self.state is not None  # set by checkpoint()
        # Grad on, and the first forward's autocast, on whatever thread replays (pipe.core.threadstate).
        with restore_rng_state(self.device, self.rng_state), self.state.replay(), enable_recomputing(), \
                trace.span("recompute", self.tag):
            # Owned inputs: an in-place layer at the partition's start works on them (pipe.core.inplace).
            output = self.function(self.guard.replay(self.batch.with_tensors(inputs)))
        self.guard.learn_differentiable(self.requires_grad, output.tensors)
        assumed = self.differentiable
        late = [k for k, t in enumerate(output.tensors) if t.requires_grad and assumed is not None and not assumed[k]]
        if late:
            raise RuntimeError(
                f"{self.guard.where} recomputed output tensor(s) {late} of micro-batch {self.tag} needing a "
                "gradient, which its earlier forwards with grad on made without one, so its checkpointed "
                "forward passed them on as needing none and their gradient cannot come back; this step is "
                "refused. Run the step again (the partition now knows they need one), or use "
                "checkpoint='never' for a partition whose outputs need a gradient only for some inputs")
        return output.tensors, inputs

    def recompute_ahead(self) -> None:
        """Recomputes now, before the gradient arrives; Recompute then finds the work done.

        The thread pipeline calls this in a worker that is waiting for the next
        partition's gradient (see :mod:`pipe.threads.worker_backward`).
        """
        if self.offload is None and not self.recomputed:  # offloaded inputs: Recompute unpacks them
            # Autograd checks the versions of what Recompute saved; these are read directly.
            verify_unmodified(self.batch.tensors, self.kept_versions, f"the cell {self.tag}")
            self.recomputed.append(self.replay(self.batch.tensors))

    def recompute(self, output: Batch) -> None:
        """Puts Recompute on ``output``'s first tensor so that it runs before Checkpoint's backward."""
        if not any(t.requires_grad for t in output.tensors):
            return
        tensor, phony = fork(output.tensor)
        if self.offload is None:
            phony = Recompute.apply(phony, self, *self.batch.tensors)
        else:
            with self.offload():
                phony = Recompute.apply(phony, self, *self.batch.tensors)
            # Recompute saved the input (offloaded); keep only its structure here.
            self.batch = self.batch.with_tensors([t.new_empty(0) for t in self.batch.tensors])
        output.tensor = join(tensor, phony)


def cell(
    function: Function, batch: Batch, checkpoint: bool, tag: tuple[int, int],
    offload: Optional[Callable[[], ContextManager[Any]]] = None, guard: Optional[InputGuard] = None,
) -> tuple[Callable[[], Batch], Callable[[Batch], None], Optional[Checkpointing]]:
    """How to run one (micro-batch, partition) cell, checkpointed or not.

    The one recipe that the thread runner (:mod:`pipe.threads.pipeline`) and the
    process runner (:mod:`pipe.distributed.runtime`) share: ``compute()``
    produces the output (where: a worker thread or the rank's main thread);
    ``finalize(output)`` then runs in the caller, before anything consumes the
    output: for a checkpointed cell it wires :class:`Recompute` ahead of the
    output's gradient, for the others it lets :mod:`pipe.trace` time the
    backward.

    Args:
        function: the partition applied to a batch.
        batch: the input micro-batch.
        checkpoint: whether to drop activations and recompute them in backward.
        tag: (micro-batch, stage), for traces.
        offload: for a checkpointed cell, where its kept input waits
            (see :class:`Checkpointing`); None keeps it on the device.
        guard: the partition's :class:`pipe.core.inplace.InputGuard` (see :class:`Checkpointing`).

    The partition runs on inputs it owns (:func:`pipe.core.inplace.own`), so
    an in-place layer at its start works as in the plain model.

    Returns:
        ``(compute, finalize, record)``; ``record`` is the cell's
        :class:`Checkpointing` when it is checkpointed, else None.
    """
    if checkpoint:
        chk = Checkpointing(function, batch, tag=tag, offload=offload, guard=guard)
        return chk.checkpoint, chk.recompute, chk

    def compute() -> Batch:
        return guard.call(function, batch) if guard is not None else function(own(batch))

    def finalize(output: Batch) -> None:
        trace.watch_backward(batch.tensors, output.tensors, tag)  # pipe.trace: times the backward

    return compute, finalize, None


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, chk: Checkpointing, *input: Tensor) -> tuple[Tensor, ...]:
        ctx.chk = chk
        chk.rng_state = save_rng_state(chk.device)
        with torch.no_grad(), enable_checkpointing():
            # The replay's input as it was, whatever the partition does to it in place (pipe.core.inplace).
            output, chk.batch = chk.guard.checkpoint(chk.function, chk.batch)
        chk.kept_versions = versions_of(chk.batch.tensors)
        chk._output = output
        tensors = output.tensors
        # Outputs that the partition's forwards with grad on made without a gradient (tables made from
        # buffers) get none here either: the next partition would compute one for nothing.
        chk.differentiable = known = chk.guard.differentiable(chk.requires_grad, len(tensors))
        ctx.mark_non_differentiable(*[t for k, t in enumerate(tensors) if not (t.is_floating_point() or t.is_complex())
                                      or (known is not None and not known[k])])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
        chk: Checkpointing = ctx.chk
        if torch.is_grad_enabled():
            # The gradient computed below carries no graph: a double backward would miss terms.
            raise RuntimeError(
                "create_graph=True (double backward, e.g. a gradient penalty) is not supported through a "
                "checkpointed micro-batch; use checkpoint='never' (or model.eval()) for such a step"
            )
        outputs, inputs = chk.recomputed.pop()
        pairs = [(o, g) for o, g in zip(outputs, grad_output) if o.requires_grad and g is not None]
        if pairs and not torch.autograd._is_checkpoint_valid():
            # torch.autograd.grad(...) / backward(inputs=...): the inputs' gradients only, nothing into .grad.
            wanted = [x for x in inputs if x.requires_grad]
            found = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True)) if wanted else []
            return (None, None) + tuple(found.pop(0) if x.requires_grad else None for x in inputs)
        if pairs:
            with trace.span("backward", chk.tag):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grad_input = tuple(x.grad if x.requires_grad else None for x in inputs)
        return (None, None) + grad_input


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, chk: Checkpointing, *input: Tensor) -> Tensor:
        ctx.chk = chk
        ctx.inputs = len(input)
        ctx.save_for_backward(*input)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, ...]:
        chk: Checkpointing = ctx.chk
        # Unpacked only when needed: a replay ahead may have modified them in place (pipe.core.inplace).
        if not chk.recomputed:  # unless recompute_ahead() did it already
            chk.recomputed.append(chk.replay(ctx.saved_tensors))
        return (None, None) + (None,) * ctx.inputs
