"""Gradient accumulation over several steps: one optimizer step from k forward/backward passes, exactly.

``DistributedPipe.step(..., accumulate=True)`` runs a pass whose gradients
stay on this rank: its lowered program has no reduce at all
(:func:`pipe.core.lowering.lower` with ``reduce=False``), so FSDP keeps the
pass's gradients unsharded and adds the next pass's to them (FSDP2's own
accumulation without sync), and replicas average nothing yet. The next
``step()`` without ``accumulate`` is the last pass: it reduces once (one
reduce-scatter per FSDP stage, one average over the replicas), then divides
the gradients of all the passes by their global count, so they are the plain
model's for the loss over every pass's batch on every data-parallel rank:

- ``loss_reduction="count"``: the token mean over all of them, whatever the
  number of tokens each pass and each rank holds;
- ``"mean"``: the sample mean over all of them (each micro-batch's mean is
  weighted by its samples, and the last pass divides by the samples of all);
- ``"sum"``: the sum over the passes (averaged over the replicas, as one step is).

The passes' gradients are kept apart from what ``.grad`` held before the first
(:class:`pipe.distributed.loss.StepGradients`), as a ``"count"`` step's are,
and added to it at the end. Until the last pass an optimizer step over the
pipeline's parameters is refused (its gradients are not reduced, and under
FSDP not even in ``.grad``), and so are ``eval_step``, ``forward`` and
``clip_grad_norm_``.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pipe.distributed.loss import StepGradients

__all__: list[str] = []

logger = logging.getLogger(__name__)


class Accumulation:
    """The passes of one optimizer step so far: their gradients kept apart, their losses and counts summed.

    Args:
        module: the ``DistributedPipe`` (its parameters).
        guard: refuse an optimizer step over ``module``'s parameters until :meth:`release`
            (an accumulation of several passes; a single ``"count"`` step needs none).
    """

    def __init__(self, module: nn.Module, guard: bool) -> None:
        self.gradients = StepGradients(module)
        self.passes = 0
        self.loss: Optional[Tensor] = None
        self.count: Optional[Tensor] = None
        self._guard = None
        if guard:
            owned = {id(p) for p in module.parameters()}
            self._guard = register_optimizer_step_pre_hook(_OptimizerGuard(self, owned))

    def add(self, loss: Optional[Tensor], count: Optional[Tensor]) -> None:
        """One more pass: its loss (a sum, on the last stage's rank) and count (float64, there; None elsewhere)."""
        self.passes += 1
        if loss is not None:
            self.loss = loss if self.loss is None else self.loss + loss
        if count is not None:
            self.count = count if self.count is None else self.count + count

    def local_count(self, device: torch.device) -> Tensor:
        """This replica's count over the passes, float64 (zero off the last stage's rank)."""
        return self.count if self.count is not None else torch.zeros((), dtype=torch.float64, device=device)

    def refuse(self, where: str) -> RuntimeError:
        """The error for ``where`` (a call that needs whole gradients, or none pending) during the accumulation."""
        return RuntimeError(
            f"{where} while {self.passes} pass(es) of step(..., accumulate=True) wait for the pass that ends the "
            f"accumulation: their gradients are not reduced yet (under FSDP not even in .grad). Call step(...) "
            f"without accumulate=True for the last pass first; it reduces the gradients once and divides them by "
            f"the count of all the passes")

    def release(self) -> None:
        """The accumulation is over (its last pass ended, or it was abandoned): optimizer steps are allowed again."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def abandon(self) -> None:
        """A pass failed: the passes' gradients are dropped, what ``.grad`` held before the first is put back."""
        self.gradients.abandon()
        self.release()
        logger.info("an accumulation of %d pass(es) was abandoned: its gradients are dropped", self.passes)


class _OptimizerGuard:
    """An optimizer step pre-hook that refuses a step over the accumulating pipeline's parameters."""

    def __init__(self, accumulation: Accumulation, owned: set[int]) -> None:
        self.accumulation = weakref.ref(accumulation)
        self.owned = owned

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        accumulation = self.accumulation()
        if accumulation is None:
            return
        if any(id(p) in self.owned for group in optimizer.param_groups for p in group["params"]):
            raise accumulation.refuse(f"{type(optimizer).__name__}.step()")
