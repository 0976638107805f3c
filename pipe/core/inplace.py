"""In-place operations at a partition's start: inputs a partition may modify, as in the plain model.

A layer such as ``nn.ReLU(inplace=True)`` modifies its input. In the plain model
that input is the previous layer's output, a tensor inside the graph, and
autograd records the modification. A pipeline cuts the graph at partition
boundaries and hands a partition tensors of its own making; two kinds refuse an
in-place operation that the plain model accepts, and one kind makes the
recomputation replay from the wrong values:

1. **Detached leaves.** The recomputation in backward, the worker backward of
   CPU partitions (:mod:`pipe.threads.worker_backward`), the activations a
   ``DistributedPipe`` stage receives and the balancers' profiling all run a
   partition on ``x.detach().requires_grad_()``, a leaf; PyTorch refuses "a leaf
   Variable that requires grad is being used in an in-place operation".
2. **Split views.** A micro-batch of the pipeline's input is a view made by
   ``tensor_split``, whose outputs PyTorch refuses to modify in place when they
   require grad.

   :func:`own` fixes both at the root: the tensors that require grad pass through
   one identity node, so the partition receives non-leaf tensors that are not
   views, share the memory of the leaf or view (no copy), and send their
   gradient to it. Every cell runs on owned inputs (:func:`pipe.core.checkpoint.cell`).

3. **The input a checkpoint keeps.** A checkpointed cell runs its first forward
   under ``no_grad`` and keeps its input to replay the forward in backward. A
   partition that modifies that input in place would leave the replay starting
   from modified values: exact for idempotent operations (ReLU, Hardtanh), wrong
   for LeakyReLU, ELU, in-place dropout or ``add_``.
4. **Micro-batches of one tensor.** The first partition's micro-batches are
   slices of the caller's tensors, and slices of a tensor share its autograd
   version counter. An in-place operation on one micro-batch would make the
   tensors other micro-batches saved for backward look modified ("one of the
   variables needed for gradient computation has been modified by an inplace
   operation"), although their slices were not.

:class:`InputGuard` fixes 3 and 4. It learns, per partition, whether the
partition modifies its input in place: version counters tell after a forward.
A checkpointed cell keeps a copy of each input tensor the partition modifies
(all of them until the guard knows) for its replay. The first partition
(``shared``) never modifies the caller's tensors: where it modifies its input,
each of its cells (first forward and replay alike) runs on copies of the
tensors it modifies, so that each micro-batch modifies a tensor of its own.
These are the copies that cannot be avoided (the replay needs the values as
they were; slices cannot have version counters of their own). A partition that
leaves its input alone runs with no copy (after the first partition's first
cell, which runs on a copy while the guard learns), and is checked by version
counter, so that one that starts modifying its input later fails loudly
instead of replaying wrong values. Unlike the plain model, a pipeline
therefore leaves the caller's input tensor unmodified.

5. **Outputs that are the input.** A partition returning its input or a view
   of it (``nn.Identity``, ``nn.Flatten`` on a flat tensor) would let the next
   partition's in-place layer reach a kept replay input or a slice of the
   caller's tensor. :func:`unalias` copies just those outputs. What still
   reaches a kept input (a skip connection popped and modified in place) is
   caught by :func:`verify_unmodified` before a replay, or by autograd's own
   version check of what ``Recompute`` saved.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pipe.core.microbatch import Batch

__all__: list[str] = []

logger = logging.getLogger(__name__)


class _Own(torch.autograd.Function):
    """Identity whose outputs are fresh non-leaf tensors sharing their inputs' memory."""

    @staticmethod
    def forward(ctx: Any, *input: Tensor) -> tuple[Tensor, ...]:
        # detach() shares memory and version counter; autograd does not treat it as a view of the input.
        return tuple(x.detach() for x in input)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Tensor, ...]:
        return grad_output


def own(batch: Batch) -> Batch:
    """``batch`` with each tensor that requires grad replaced by a non-leaf, non-view tensor sharing its memory.

    The partition may then modify its input in place as the plain model's layer
    would modify the previous layer's output. Nothing is copied; without grad
    mode, or when no tensor requires grad, ``batch`` itself is returned.
    """
    tensors = batch.tensors
    index = [k for k, t in enumerate(tensors) if t.requires_grad]
    if not index or not torch.is_grad_enabled():
        return batch
    owned = _Own.apply(*[tensors[k] for k in index])
    for k, tensor in zip(index, owned):
        tensors[k] = tensor
    return batch.with_tensors(tensors)


def plain_tensors(leaves: Iterable[Any]) -> Iterator[Tensor]:
    """The tensors among ``leaves`` that own storage: a wrapper subclass (a DTensor) stands for those it wraps."""
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            attributes, _ = leaf.__tensor_flatten__()
            yield from plain_tensors(getattr(leaf, name) for name in attributes)
        else:
            yield leaf


def _storage(tensor: Tensor) -> Optional[int]:
    tensor = next(plain_tensors([tensor]), tensor)  # a DTensor: the memory of the tensor it wraps
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    return tensor.untyped_storage().data_ptr()


def unalias(output: Batch, inputs: Sequence[Tensor]) -> Batch:
    """``output`` with each tensor that shares memory with one of ``inputs`` replaced by a copy.

    A partition that returns its input or a view of it (``nn.Identity``,
    ``nn.Flatten``) would let the next partition's in-place layer modify that
    input: a checkpoint's replay input, or a slice of the caller's tensor. The
    copy is made only for such outputs (grad mode as the caller's).
    """
    storages = {_storage(t) for t in inputs} - {None, 0}
    if not storages:
        return output
    tensors = output.tensors
    aliased = [k for k, t in enumerate(tensors) if _storage(t) in storages]
    if not aliased:
        return output
    for k in aliased:
        tensors[k] = tensors[k].clone()
    return output.with_tensors(tensors)


def _version(tensor: Tensor) -> Optional[int]:
    # Inference tensors keep no version counter (and cannot be modified outside inference mode).
    return None if tensor.is_inference() else tensor._version


def describe_partition(index: int, partition: nn.Module, what: str = "partition") -> str:
    """``"partition 1 (first layer '4': ReLU)"``: where a partition's input is modified, for messages."""
    children = list(partition.named_children())
    if not children:
        return f"{what} {index} ({type(partition).__name__})"
    name, layer = children[0]
    return f"{what} {index} (first layer {name!r}: {type(layer).__name__})"


class InputGuard:
    """Keeps the partition's in-place operations from touching what its replay or other micro-batches need.

    One per partition (or ``DistributedPipe`` stage), used by every cell of
    it, from one thread at a time.

    What a partition modifies is learned per training mode of its layers
    (``nn.Dropout(inplace=True)`` modifies its input in training only), so an
    evaluation pass does not vouch for training.

    Args:
        where: the partition, for messages (:func:`describe_partition`).
        shared: the partition's micro-batches are slices of one tensor (the
            first partition's are slices of the caller's input).
        partition: the partition, whose layers' training flags select what was learned.
    """

    def __init__(self, where: str, shared: bool = False, partition: Optional[nn.Module] = None) -> None:
        self.where = where
        self.shared = shared
        self.partition = partition
        # Per training mode: positions of the input tensors the partition modifies in place; absent until it ran.
        self._learned: dict[tuple[bool, ...], frozenset[int]] = {}
        # Per training mode and input tensors needing a gradient: which outputs need one (seen with grad on).
        self._differentiable: dict[tuple[tuple[bool, ...], tuple[bool, ...]], tuple[bool, ...]] = {}

    def _mode(self) -> tuple[bool, ...]:
        if self.partition is None:
            return ()
        return tuple(layer.training for layer in self.partition.children()) or (self.partition.training,)

    @property
    def modified(self) -> Optional[frozenset[int]]:
        """What the partition modifies in its layers' current mode; None until known."""
        return self._learned.get(self._mode())

    @modified.setter
    def modified(self, value: frozenset[int]) -> None:
        self._learned[self._mode()] = value

    def _observe(self, tensors: list[Tensor], before: list[Optional[int]]) -> frozenset[int]:
        changed = frozenset(k for k, (t, v) in enumerate(zip(tensors, before)) if v is not None and _version(t) != v)
        mode = self._mode()  # once: it walks the partition's layers
        known = self._learned.get(mode)
        if known is not None and known >= changed:
            return changed  # nothing new (every call after the first, for most partitions)
        if changed and not (known or frozenset()) >= changed:
            logger.info("%s modifies its input tensor(s) %s in place: copies of them are kept for its "
                        "recomputation%s", self.where, sorted(changed),
                        ", and its micro-batches each modify a copy" if self.shared else "")
        self._learned[mode] = changed if known is None else known | changed
        return changed

    def differentiable(self, needs: Sequence[bool], outputs: int) -> Optional[tuple[bool, ...]]:
        """Which of the partition's ``outputs`` tensors need a gradient when its input tensors need one as
        ``needs`` says, as learned from its forwards with grad on; None until one ran.

        A checkpointed cell's first forward runs without grad, so autograd cannot tell it; without
        this, every floating-point output of it would need a gradient, and the next partition would
        compute and send back gradients for tensors made from buffers alone (a table made from a saved
        buffer) that the replay then drops.
        """
        known = self._differentiable.get((self._mode(), tuple(needs)))
        return known if known is not None and len(known) == outputs else None

    def learn_differentiable(self, needs: Sequence[bool], outputs: Sequence[Tensor]) -> None:
        """Records which ``outputs`` of a forward with grad on need a gradient (an output once seen
        needing one is taken to need one always)."""
        key = (self._mode(), tuple(needs))
        seen = tuple(t.requires_grad for t in outputs)
        known = self._differentiable.get(key)
        if known is not None and len(known) == len(seen):
            seen = tuple(a or b for a, b in zip(known, seen))
        self._differentiable[key] = seen

    def _copy(self, batch: Batch, copied: Optional[frozenset[int]]) -> Batch:
        return batch.with_tensors([t.clone() if copied is None or k in copied else t
                                   for k, t in enumerate(batch.tensors)])

    def call(self, function: Callable[[Batch], Batch], batch: Batch) -> Batch:
        """``function`` on ``batch`` in a cell that is not checkpointed (grad mode as the caller's).

        The partition gets owned inputs (:func:`own`); on the shared (first)
        partition, copies of the tensors it modifies (of all, until the guard knows).
        """
        modified = self.modified if self.shared else None
        if self.shared and modified != frozenset():
            batch = self._copy(batch, modified)
        tensors = batch.tensors
        before = [_version(t) for t in tensors]
        output = function(own(batch))
        self._observe(tensors, before)
        if torch.is_grad_enabled():
            self.learn_differentiable([t.requires_grad for t in tensors], output.tensors)
        # An output sharing a slice's memory would let the next partition modify the caller's tensor.
        return unalias(output, tensors) if self.shared else output

    def checkpoint(self, function: Callable[[Batch], Batch], batch: Batch) -> tuple[Batch, Batch]:
        """``function`` on ``batch`` in a checkpointed cell's first forward (no grad), and the input to replay.

        Returns:
            ``(output, kept)``: ``kept`` holds ``batch``'s tensors as they were
            before the forward: copies of those the partition modifies (all,
            until the guard knows), the others themselves. On the shared
            partition the forward runs on the copies and ``kept`` is ``batch``.

        Raises:
            RuntimeError: the partition modified an input tensor in place that
                its earlier forwards left alone, so no copy was kept and the
                replay in backward would start from modified values.
        """
        copied = frozenset(range(len(batch.tensors))) if self.modified is None else self.modified
        copy = self._copy(batch, copied)
        run, kept = (copy, batch) if self.shared else (batch, copy)
        tensors = run.tensors
        before = [_version(t) for t in tensors]
        output = function(run)
        unexpected = sorted(self._observe(tensors, before) - copied)
        if unexpected:
            raise RuntimeError(
                f"{self.where} modified its input tensor(s) {unexpected} in place in a checkpointed forward, "
                "which its earlier forwards did not do, so no copy was kept and the recomputation in backward "
                "would replay from the modified values; this step is refused. Run the step again (this "
                "partition now keeps copies of those inputs), or make the layer not modify its input "
                "(e.g. inplace=False)"
            )
        # An output sharing the kept input's memory would let the next partition modify the replay's input.
        return unalias(output, kept.tensors), kept

    def replay(self, batch: Batch) -> Batch:
        """The input of a replay in backward: owned; on the shared partition, copies of what it modifies."""
        if self.shared and self.modified:
            batch = self._copy(batch, self.modified)
        return own(batch)


def versions_of(tensors: Sequence[Tensor]) -> list[Optional[int]]:
    """The version counters of ``tensors`` (None for inference tensors)."""
    return [_version(t) for t in tensors]


def verify_unmodified(tensors: Sequence[Tensor], versions: Sequence[Optional[int]], where: str) -> None:
    """Raises if a replay's input was modified in place since it was kept.

    Raises:
        RuntimeError: naming ``where`` and the fix.
    """
    changed = [k for k, (t, v) in enumerate(zip(tensors, versions)) if v is not None and _version(t) != v]
    if changed:
        raise RuntimeError(
            f"the input tensor(s) {changed} kept to recompute {where} in backward were modified in place after "
            "its forward (by a later layer, through a tensor sharing their memory, e.g. a skip connection), so "
            "the recomputation would start from wrong values. Make that later layer not modify its input "
            "(inplace=False), or pass it a copy (.clone()), or do not checkpoint this partition"
        )
