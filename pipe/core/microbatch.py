"""Micro-batches: split a mini-batch on dim 0, stream the pieces, put them back.

A value flowing through the pipeline may be a tensor, or a tuple/list/dict of
tensors and other things (masks, flags, ``None``). Every tensor is split on
dim 0 into ``chunks`` micro-batches; every non-tensor, and every tensor
wrapped in :class:`NoChunk`, reaches each micro-batch unchanged. :class:`Batch`
keeps the structure and exposes the flat list of tensors that autograd
functions, copies and sends work on.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

__all__: list[str] = []

logger = logging.getLogger(__name__)

# A structure is described by a tree of ("leaf",), ("tuple"|"list", [specs]) or
# ("dict", [keys], [specs]); leaves are stored flat in order.
Spec = tuple[Any, ...]
_LEAF: Spec = ("leaf",)


def flatten(value: Any) -> tuple[list[Any], Spec]:
    """Flattens nested tuples/lists/dicts into leaves and a structure spec."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        leaves: list[Any] = []
        specs = []
        for item in value:
            item_leaves, item_spec = flatten(item)
            leaves.extend(item_leaves)
            specs.append(item_spec)
        return leaves, ("tuple" if isinstance(value, tuple) else "list", specs)
    if isinstance(value, dict):
        leaves = []
        specs = []
        for item in value.values():
            item_leaves, item_spec = flatten(item)
            leaves.extend(item_leaves)
            specs.append(item_spec)
        return leaves, ("dict", list(value.keys()), specs)
    return [value], _LEAF


def unflatten(leaves: Sequence[Any], spec: Spec) -> Any:
    """Inverse of :func:`flatten`."""
    iterator = iter(leaves)
    value = _build(iterator, spec)
    return value


def _build(leaves: Iterator[Any], spec: Spec) -> Any:
    kind = spec[0]
    if kind == "leaf":
        return next(leaves)
    if kind == "dict":
        return {key: _build(leaves, sub) for key, sub in zip(spec[1], spec[2])}
    items = [_build(leaves, sub) for sub in spec[1]]
    return tuple(items) if kind == "tuple" else items


class NoChunk:
    """An input tensor that every micro-batch receives whole instead of a slice of dim 0.

    For a tensor with no batch dimension (a lookup table, an attention bias
    shared by all samples). Inside the pipeline it is an ordinary tensor: it
    moves between devices, and its gradient is the sum over the micro-batches,
    as the plain module computes it on the whole batch.

    Usage::

        output = pipe(x, NoChunk(bias))     # each micro-batch: (slice of x, bias)

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(tensor).__name__}; "
                            "other values reach every micro-batch unchanged without it")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk(Tensor{tuple(self.tensor.shape)})"


class Batch:
    """One micro-batch: a value of any structure and the tensors inside it.

    Autograd functions, stream copies and point-to-point sends see
    :attr:`tensors`; layers see :attr:`value`. Replacing tensors keeps the
    structure and every non-tensor leaf.
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self._leaves, self._spec = flatten(value)
        self._tensor_index = [i for i, leaf in enumerate(self._leaves) if isinstance(leaf, Tensor)]

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors of the value, in structure order."""
        return [self._leaves[i] for i in self._tensor_index]

    def _lane(self) -> int:
        if not self._tensor_index:
            raise TypeError(
                f"a value crossing a partition boundary holds no tensor ({_describe(self.value)}); "
                "every layer output must contain at least one tensor"
            )
        for k, i in enumerate(self._tensor_index):
            if self._leaves[i].requires_grad:
                return k
        return 0

    @property
    def tensor(self) -> Tensor:
        """The lane that fork/join attach to: the first tensor that requires grad, else the first."""
        return self.tensors[self._lane()]

    @tensor.setter
    def tensor(self, tensor: Tensor) -> None:
        tensors = self.tensors
        tensors[self._lane()] = tensor
        self.replace_tensors(tensors)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def replace_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Puts ``tensors`` in place of :attr:`tensors`, in order."""
        if len(tensors) != len(self._tensor_index):
            raise ValueError(f"expected {len(self._tensor_index)} tensors, got {len(tensors)}")
        for i, tensor in zip(self._tensor_index, tensors):
            self._leaves[i] = tensor
        self.value = unflatten(self._leaves, self._spec)

    def with_tensors(self, tensors: Sequence[Tensor]) -> "Batch":
        """A new batch of the same structure holding ``tensors``."""
        batch = Batch.__new__(Batch)
        batch._leaves = list(self._leaves)
        batch._spec = self._spec
        batch._tensor_index = self._tensor_index
        batch.replace_tensors(tensors)
        return batch

    def call(self, function: Callable[[Any], Any]) -> "Batch":
        """Applies ``function`` to the value, as a layer of ``nn.Sequential``."""
        return Batch(function(self.value))

    def __repr__(self) -> str:
        return f"Batch({_describe(self.value)})"


def _describe(value: Any) -> str:
    leaves, _ = flatten(value)
    parts = [f"Tensor{tuple(leaf.shape)}" if isinstance(leaf, Tensor) else type(leaf).__name__ for leaf in leaves]
    return ", ".join(parts) if parts else "empty"


def pack_inputs(inputs: tuple[Any, ...]) -> Any:
    """The value the first layer receives: the input itself, or a tuple of several."""
    return inputs[0] if len(inputs) == 1 else inputs


def scatter(value: Any, chunks: int) -> list[Batch]:
    """Splits every tensor in ``value`` on dim 0 into at most ``chunks`` pieces.

    Pieces differ in size by at most one. With fewer samples than ``chunks``,
    each sample becomes a micro-batch and a warning says so.

    Raises:
        TypeError: ``value`` contains no tensor, or a tensor with no dim 0.
        ValueError: tensors disagree on the batch size.
    """
    leaves, spec = flatten(value)
    tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    if not tensor_index:
        raise TypeError(
            f"Pipe input contains no tensor to split ({_describe(value)}); pass at least one tensor to split "
            "into micro-batches"
        )
    sizes = []
    for i in tensor_index:
        if leaves[i].dim() == 0:
            raise TypeError("Pipe input has a 0-dim tensor; tensors are split on dim 0, so each needs a batch dimension")
        sizes.append(leaves[i].size(0))
    if len(set(sizes)) != 1:
        raise ValueError(
            f"Pipe input tensors have different batch sizes {sizes}; every tensor is split on dim 0, "
            "so they must agree (pass tensors that should not be split as non-tensor arguments, "
            "or give them a batch dimension)"
        )
    size = sizes[0]
    if size == 0:
        raise ValueError("Pipe input has batch size 0; there is nothing to split into micro-batches")
    if size < chunks:
        warnings.warn(
            f"batch size {size} is smaller than chunks={chunks}: running {size} micro-batches of one sample; "
            "use a larger batch or fewer chunks to keep the pipeline full",
            stacklevel=3,
        )
    pieces = min(size, chunks)
    split = {i: leaves[i].tensor_split(pieces, dim=0) for i in tensor_index}
    whole = [leaf.tensor if isinstance(leaf, NoChunk) else leaf for leaf in leaves]
    batches = []
    for k in range(pieces):
        micro = list(whole)
        for i in tensor_index:
            micro[i] = split[i][k]
        batches.append(Batch(unflatten(micro, spec)))
    return batches


def gather(batches: Sequence[Batch]) -> Any:
    """Concatenates micro-batch outputs on dim 0, keeping their structure.

    A non-tensor leaf must be the same in every micro-batch (a flag, a
    constant passed through): the whole batch's output then holds that value,
    as the plain module's would. One that differs has no whole-batch value.

    Raises:
        ValueError: a non-tensor output differs between micro-batches.
    """
    first_leaves, spec = flatten(batches[0].value)
    if len(batches) == 1:
        return batches[0].value
    all_leaves = [flatten(batch.value)[0] for batch in batches]
    out = []
    for position, leaf in enumerate(first_leaves):
        column = [leaves[position] for leaves in all_leaves]
        if isinstance(leaf, Tensor):
            out.append(torch.cat(column, dim=0))
        else:
            for k, other in enumerate(column[1:], start=1):
                if not _same(leaf, other):
                    raise ValueError(
                        f"the output holds a non-tensor value that differs between micro-batches "
                        f"({leaf!r} in micro-batch 0, {other!r} in micro-batch {k}, at position {position} of "
                        f"({_describe(batches[0].value)})), so the whole batch has no single value for it; "
                        f"return it as a tensor with a batch dimension (split and concatenated on dim 0), "
                        f"or use chunks=1"
                    )
            out.append(leaf)
    return unflatten(out, spec)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a truth value (an array, say): only identity counts
        return False


def verify_gatherable(sizes: Sequence[int], batches: Sequence[Batch], producer: str) -> None:
    """Refuses micro-batch outputs that concatenation on dim 0 cannot turn into the mini-batch's output.

    Gathering is right for layers that treat samples independently: each
    output tensor then has ``k`` rows per input sample, the same ``k`` for
    every micro-batch (``k = 1`` mostly; ``k = seq_len`` for flattened tokens).
    A 0-dim output (a loss) or one whose dim 0 does not follow the micro-batch
    sizes (``x.mean(0)``, ``x.sum(0, keepdim=True)``) mixed the samples of
    its micro-batch, and the plain module would return something else.
    A reduction whose output happens to have ``k`` rows per sample cannot be
    told from a per-sample output by shapes, and is not caught.

    Args:
        sizes: the samples in each input micro-batch.
        batches: the output of each micro-batch.
        producer: what made the outputs, for the message (the last layer).

    Raises:
        ValueError: an output cannot be gathered; the message names the fix.
    """
    if len(batches) < 2:
        return  # one micro-batch: its output is the output
    fix = ("Pipe concatenates the micro-batches' outputs on dim 0, which cannot reproduce an output that mixes "
           "the samples of a batch (a reduction over dim 0 such as x.mean(0), or a scalar loss); use chunks=1, or "
           "return per-sample outputs and reduce them after the Pipe (in the loss)")
    all_leaves = [flatten(batch.value)[0] for batch in batches]
    for position, leaf in enumerate(all_leaves[0]):
        if not isinstance(leaf, Tensor):
            continue
        tensors = [leaves[position] for leaves in all_leaves]
        if any(t.dim() == 0 for t in tensors):
            raise ValueError(f"{producer} returned a 0-dim tensor for each micro-batch; {fix}")
        rows = [t.size(0) for t in tensors]
        per_sample = {row / size for row, size in zip(rows, sizes)}
        if len(per_sample) != 1 or any(row % size for row, size in zip(rows, sizes)):
            raise ValueError(
                f"{producer} returned tensors of {rows} rows (dim 0) for micro-batches of {list(sizes)} samples, "
                f"so its output does not follow the batch; {fix}"
            )


def verify_device(value: Any, device: torch.device, what: str, fix: str) -> None:
    """Raises ``ValueError`` naming ``fix`` if a tensor of ``value`` (a ``NoChunk``'s too) is not on ``device``."""
    for leaf in flatten(value)[0]:
        leaf = leaf.tensor if isinstance(leaf, NoChunk) else leaf
        if isinstance(leaf, Tensor) and leaf.device != device:
            raise ValueError(f"{what} is on {leaf.device} but {fix}")


def scatter_exactly(value: Any, chunks: int, what: str) -> list[Batch]:
    """Splits ``value`` into exactly ``chunks`` micro-batches, as every rank of a multi-process pipeline
    must know the count; ``what`` ("inputs" or "target") names the argument in errors."""
    if value is None:
        raise ValueError(f"this rank runs the {'first' if what == 'inputs' else 'last'} stage and needs {what}; "
                         f"pass {what}= to step()")
    batches = scatter(value, chunks)
    if len(batches) != chunks:
        raise ValueError(
            f"{what} has batch size {len(batches)}, smaller than chunks={chunks}; a multi-process "
            f"pipeline runs exactly chunks micro-batches per step (every rank must know the count), "
            f"so pass at least {chunks} samples or use fewer chunks"
        )
    return batches
