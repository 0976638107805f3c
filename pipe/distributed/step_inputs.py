"""A step's inputs and targets on one rank: checked, cut into micro-batches, and the loss weights of each.

A bad argument on one rank must not leave the others waiting in the step:
it is reported through the rank's failure channel (every rank then raises
the same :class:`pipe.distributed.failure.PipelineFailure`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pipe.core.microbatch import Batch, scatter_exactly, verify_device
from pipe.distributed.loss import LossFn, replica_share, sample_weights, warn_if_ignored_targets

if TYPE_CHECKING:
    from pipe.distributed.distributed_pipe import DistributedPipe

__all__: list[str] = []

Prepared = tuple[Optional[list[Batch]], Optional[list[Batch]], Optional[list[float]]]


def prepare_step(pipe: "DistributedPipe", inputs: Any, target: Any, loss_fn: Optional[LossFn], where: str,
                 need_target: bool, summed: bool = False) -> Prepared:
    """``pipe``'s input and target micro-batches on this rank and the loss weights; a bad argument fails every
    rank (``where`` names the call: ``"step()"``). ``summed``: a step of an accumulation, whose ``"mean"`` losses
    are weighted by their samples (:func:`pipe.distributed.loss.sample_weights`) for its last step to divide."""
    failures = pipe._runtime.failures
    targets = weights = None
    try:  # a bad argument on one rank must not leave the others waiting: report it
        batches = None
        if pipe.is_first:
            verify_device(inputs, pipe.device, "an input", _move_to(pipe, "inputs"))
            batches = scatter_exactly(inputs, pipe.chunks, "inputs")
        if pipe.is_last and need_target:
            if loss_fn is None:
                raise ValueError(f"the rank of the last stage needs loss_fn, in {where} or in the constructor")
            verify_device(target, pipe.device, "a target", _move_to(pipe, "target"))
            targets = scatter_exactly(target, pipe.chunks, "target")
            weights = sample_weights(pipe.loss_reduction, targets, summed)
            if not pipe._warned_ignored_targets:
                pipe._warned_ignored_targets = warn_if_ignored_targets(pipe.loss_reduction, target)
    except (TypeError, ValueError) as error:
        failures.begin_step()  # the step the other ranks run
        raise failures.failure_from(where, error) from None
    if targets is not None and weights is not None and pipe.loss_reduction == "mean" and not summed \
            and pipe.topology.data_parallel > 1:
        try:  # replicas with uneven shares of the global batch: weighted by their samples
            weights = replica_share(weights, targets, pipe.topology.data_parallel_group,
                                    pipe.topology.data_parallel, pipe.device)
        except Exception as error:
            failures.begin_step()
            raise failures.failure_from(where, error) from None
    return batches, targets, weights


def _move_to(pipe: "DistributedPipe", what: str) -> str:
    return f"this rank's stages are on {pipe.device}; move it with {what}.to(pipe.device)"
