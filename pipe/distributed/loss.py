"""How the micro-batches' losses make a step's loss: weighted by samples, summed, or divided by a count.

A multi-process pipeline computes the loss per micro-batch on the last
stage, and back-propagates each as soon as the schedule allows (1F1B starts
the first backward before the last forward). ``loss_reduction`` says how the
micro-batch losses combine into the whole batch's:

- ``"mean"``: ``loss_fn`` averages over samples (``F.mse_loss``,
  ``F.cross_entropy`` without ignored targets). Micro-batch i's loss is
  weighted by its share of the batch's samples, known before the step, so the
  loss and gradients are the whole batch's even with an uneven last micro-batch.
- ``"sum"``: ``loss_fn`` sums; micro-batch losses add up.
- ``"count"``: ``loss_fn`` returns ``(sum, count)``, e.g. the cross-entropy
  summed over the tokens that are not padding and the number of those tokens.
  The step's loss is the sum of the sums over the sum of the counts: exactly
  the plain model's ``F.cross_entropy(..., ignore_index=-100)`` (a mean over
  real tokens) on the whole batch. The count is known only when the last
  micro-batch's loss is, after earlier micro-batches went backward, so each
  micro-batch back-propagates its sum and, at the end of the step, this step's
  gradients (:class:`StepGradients`) and loss are divided by the count
  (Megatron's per-token loss does the same). With data parallel replicas the
  count is the global one, summed over the replicas: gradients are averaged
  over replicas, so each divides by ``count / replicas`` and the result is the
  token mean over the global batch, as one process would compute it.

``"mean"`` cannot be exact for a loss that averages over something other than
samples (real tokens of padded sequences): micro-batches hold different
numbers of them, and a mean of per-micro-batch means is not the whole batch's
mean. The pipeline cannot see what ``loss_fn`` averages over, so it warns
(once per pipeline) when ``"mean"`` meets targets holding ``-100``, the
``ignore_index`` of PyTorch's classification losses.
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipe.core.microbatch import Batch, flatten

if TYPE_CHECKING:
    from pipe.distributed.group import Topology

__all__: list[str] = []

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the default ignore_index of F.cross_entropy and F.nll_loss
LossFn = Callable[[Any, Any], Tensor]


def sample_weights(reduction: str, targets: list[Batch], summed: bool = False) -> list[float]:
    """Per micro-batch, the factor of its loss in the step's loss (before a count divides it).

    ``summed`` (``"mean"`` in an accumulation of several steps, :mod:`pipe.distributed.accumulation`): each
    micro-batch's mean weighted by its samples, a sum that the last step divides by the samples of them all.
    """
    if reduction != "mean":
        return [1.0] * len(targets)
    sizes = [t.tensors[0].size(0) for t in targets]
    if summed:
        return [float(size) for size in sizes]
    total = sum(sizes)
    return [size / total for size in sizes]


def replica_share(weights: list[float], targets: list[Batch], group: Optional[dist.ProcessGroup], replicas: int,
                  device: torch.device) -> list[float]:
    """``weights`` scaled so that the replicas' average is the mean over the global batch (``"mean"``).

    Gradients and losses are averaged over the data-parallel ranks with equal
    weights, which is the global batch's mean only when every rank holds as
    many samples. A rank holding ``n`` of the global batch's ``N`` samples
    weighs its loss by ``n * replicas / N`` (1 when the split is even: then
    nothing changes), so a global batch of 7 split 4/3 gets the mean over 7.
    Every last-stage rank of the data-parallel group calls it (one all-reduce).
    """
    rows = sum(t.tensors[0].size(0) for t in targets)
    counts = torch.tensor([rows], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    total = int(counts.item())
    if total == rows * replicas:
        return weights
    factor = rows * replicas / total
    return [w * factor for w in weights]


def warn_if_ignored_targets(reduction: str, target: Any) -> bool:
    """Warns when ``"mean"`` meets integer targets holding :data:`IGNORE_INDEX`; returns whether it warned."""
    if reduction != "mean":
        return False
    for leaf in flatten(target)[0]:
        if isinstance(leaf, Tensor) and not leaf.is_floating_point() and not leaf.is_complex() \
                and leaf.dtype != torch.bool and bool((leaf == IGNORE_INDEX).any()):
            warnings.warn(
                f"the targets hold {IGNORE_INDEX} (the ignore_index of F.cross_entropy) and loss_reduction='mean' "
                "weights each micro-batch's loss by its share of the samples; if loss_fn averages over the "
                "targets that are not ignored (tokens that are not padding), micro-batches hold different "
                "numbers of them and the step's loss and gradients are NOT the whole batch's. For the exact "
                "token mean, return (sum, count) from loss_fn, e.g. (F.cross_entropy(..., reduction='sum'), "
                f"(labels != {IGNORE_INDEX}).sum()), with loss_reduction='count'",
                stacklevel=3,
            )
            return True
    return False


class CountedLoss:
    """Wraps a ``loss_fn`` returning ``(sum, count)``: returns the sum to back-propagate, keeps the count.

    Args:
        loss_fn: ``loss_fn(output, target) -> (sum, count)``; ``sum`` a scalar
            tensor, ``count`` a number or a one-element tensor.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.loss_fn = loss_fn
        self.counts: list[Tensor] = []

    def __call__(self, output: Any, target: Any) -> Tensor:
        result = self.loss_fn(output, target)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            got = (f"a tensor of shape {tuple(result.shape)}" if isinstance(result, Tensor)
                   else type(result).__name__)
            raise TypeError(
                f"with loss_reduction='count', loss_fn must return (sum, count), got {got}; e.g. "
                f"(F.cross_entropy(logits, labels, reduction='sum'), (labels != {IGNORE_INDEX}).sum()), "
                "or use loss_reduction='mean' for a loss that averages over samples"
            )
        total, count = result
        if not isinstance(total, Tensor):
            raise TypeError(f"loss_fn returned (sum, count) with a sum of type {type(total).__name__}; "
                            "the sum must be a tensor that requires grad (reduction='sum')")
        if isinstance(count, Tensor):
            if count.numel() != 1:
                raise TypeError(f"loss_fn returned a count of shape {tuple(count.shape)}; it must be one number, "
                                "e.g. (labels != -100).sum()")
            count = count.detach().reshape(()).to(device=total.device, dtype=torch.float64)
        elif isinstance(count, (int, float)) and not isinstance(count, bool):
            count = torch.tensor(float(count), dtype=torch.float64, device=total.device)
        else:
            raise TypeError(f"loss_fn returned a count of type {type(count).__name__}; it must be a number or "
                            "a one-element tensor")
        self.counts.append(count)
        return total

    def total(self, device: torch.device) -> Tensor:
        """The sum of the counts so far (float64, on ``device``)."""
        if not self.counts:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(self.counts).sum().to(device)


def global_count(local: Tensor, is_last: bool, data_parallel_group: Optional[dist.ProcessGroup],
                 replicas: int, broadcast: Callable[[Optional[Tensor]], Tensor]) -> float:
    """The count of the whole step over every replica, on every rank of the pipeline.

    Args:
        local: this replica's count on the rank of the last stage, a float64 zero elsewhere.
        is_last: whether this rank runs the last stage.
        data_parallel_group: the ranks holding the same stages in the other replicas.
        replicas: how many replicas the count is summed over.
        broadcast: sends the last stage's value to the pipeline's other ranks.

    Raises:
        ValueError: the count is 0 (every target ignored: the mean is undefined).
    """
    if is_last and replicas > 1:
        local = local.clone()
        dist.all_reduce(local, group=data_parallel_group)
    count = float(broadcast(local).item())
    if count <= 0:
        raise ValueError(
            f"loss_fn counted {count:g} items over the whole step (every target ignored?); the mean over them is "
            "undefined. Skip such batches, or use loss_reduction='sum'"
        )
    return count


class StepGradients:
    """Keeps this step's gradients apart from those accumulated before it, to scale them at the end.

    Gradients accumulated by earlier steps are set aside (no copy: the
    ``.grad`` tensors themselves) and ``.grad`` starts empty; :meth:`finish`
    scales what this step accumulated and adds the earlier gradients back.

    Args:
        parameters: this rank's parameters.
    """

    def __init__(self, module: nn.Module) -> None:
        self.held: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        for parameter in module.parameters():
            self.held.append((parameter, parameter.grad))
            parameter.grad = None

    def finish(self, scale: float) -> None:
        """``.grad = earlier + scale * this step's``."""
        for parameter, earlier in self.held:
            grad = parameter.grad
            if grad is not None:
                if scale != 1.0:
                    grad.mul_(scale)
                if earlier is not None:
                    grad = earlier.add_(grad)
            parameter.grad = grad if grad is not None else earlier
        self.held = []

    def abandon(self) -> None:
        """Puts the earlier gradients back and drops this step's (a failed step)."""
        for parameter, earlier in self.held:
            parameter.grad = earlier
        self.held = []


def divide_by_count(local: Tensor, loss: Optional[Tensor], step_grads: StepGradients, *,
                    is_last: bool, data_parallel_group: Optional[dist.ProcessGroup], replicas: int,
                    broadcast: Callable[[Optional[Tensor]], Tensor]) -> Optional[Tensor]:
    """Ends a ``"count"`` step: divides its gradients and this replica's loss by the global count.

    Every rank of the pipeline calls it (see :func:`global_count` for the
    arguments; ``local`` is this replica's count, float64, on the last stage's rank).
    Replicas' gradients and losses are averaged afterwards, so
    each divides by its share of the global count, ``count / replicas``.

    Returns:
        The loss divided (on the rank of the last stage; None elsewhere).

    Raises:
        ValueError: the global count is 0; this step's gradients are dropped.
    """
    try:
        count = global_count(local, is_last, data_parallel_group, replicas, broadcast)
    except ValueError:
        step_grads.abandon()
        raise
    scale = replicas / count
    step_grads.finish(scale)
    return loss * scale if loss is not None else None


def micro_batch_loss(loss_fn: LossFn, output: Any, target: Any, microbatch: int) -> Tensor:
    """``loss_fn(output, target)`` as a scalar, or a clear error (a tuple, many elements, sharded logits)."""
    try:
        loss = loss_fn(output, target)
    except (RuntimeError, NotImplementedError) as error:
        sharded = [leaf.placements for leaf in flatten(output)[0] if isinstance(leaf, DTensor)]
        if not sharded:
            raise
        raise type(error)(
            f"{error}\nloss_fn got the last stage's output as a DTensor (placements {sharded[0]}): for logits "
            f"sharded on the vocabulary (Shard(-1)), run the step under torch's loss parallelism, `with "
            f"torch.distributed.tensor.parallel.loss_parallel(): pipe.step(...)`; otherwise gather the output "
            f"in the tensor-parallel plan (output_layouts=Replicate(), use_local_output=True)") from error
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        described = type(loss).__name__ if not isinstance(loss, Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        hint = (" (a loss returning (sum, count) needs loss_reduction='count')"
                if isinstance(loss, (tuple, list)) else "")
        raise TypeError(
            f"loss_fn returned {described} for micro-batch {microbatch}; it must return a scalar tensor "
            f"(reduce the loss, e.g. with reduction='mean'){hint}"
        )
    return loss.reshape(())


def reported_loss(loss: Tensor) -> Tensor:
    """A micro-batch's loss as a plain tensor (under torch's ``loss_parallel`` it is a replicated ``DTensor``)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def broadcast_from(value: Optional[Tensor], source: int, group: Optional[dist.ProcessGroup],
                   device: torch.device) -> Tensor:
    """``value`` from global rank ``source`` on every rank of ``group``, as float32 (a loss may be bfloat16)."""
    buffer = value.detach().float().clone() if value is not None else torch.zeros((), device=device)
    dist.broadcast(buffer, source, group=group)
    return buffer


def share_loss(loss: Optional[Tensor], topology: "Topology", source: int, group: Optional[dist.ProcessGroup],
               device: torch.device, *, is_last: bool, average: bool, broadcast: bool) -> Optional[Tensor]:
    """The loss averaged over data-parallel replicas (``average``), and sent from the last stage's rank
    ``source`` to every rank of the pipeline (``broadcast``)."""
    if average and loss is not None and is_last and topology.data_parallel > 1:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=topology.data_parallel_group)
        loss /= topology.data_parallel
    if broadcast and topology.ranks > 1:
        loss = broadcast_from(loss, source, group, device)
    return loss


def divide_step_by_count(local: Tensor, loss: Optional[Tensor], step_grads: StepGradients,
                         topology: "Topology", source: int, group: Optional[dist.ProcessGroup], device: torch.device,
                         *, is_last: bool) -> Optional[Tensor]:
    """Divides a step's gradients and loss by the global count (``loss_reduction="count"``, or the samples of an
    accumulation); ``local``: this replica's count on the last stage's rank. Every rank learns the same count
    from the last stage's rank ``source``, so a count of 0 raises the same error everywhere."""
    def broadcast(value: Optional[Tensor]) -> Tensor:
        if topology.ranks == 1:
            if value is None:
                raise RuntimeError("a one-rank pipeline has no count: a bug in pipe, please report it")
            return value
        return broadcast_from(value, source, group, device)

    return divide_by_count(local, loss, step_grads, is_last=is_last, data_parallel_group=topology.data_parallel_group,
                           replicas=topology.data_parallel, broadcast=broadcast)
