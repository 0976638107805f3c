"""Deferred BatchNorm: running statistics updated once per mini-batch, as without micro-batches.

In a pipeline a BatchNorm layer sees micro-batches. Normalising each
micro-batch with its own statistics is inherent to micro-batching, but
updating the running statistics once per micro-batch is not: with ``chunks``
micro-batches the running mean would move ``chunks`` times per step, towards
noisier estimates, and a checkpointed micro-batch would be counted again when
it is recomputed. :class:`DeferredBatchNorm` records each micro-batch's count,
mean and variance (not under recomputation), and :meth:`~DeferredBatchNorm.commit`,
called by ``Pipe`` once the mini-batch has gone through, combines them into the
statistics of the whole mini-batch (exactly, with Chan's parallel formula) and
updates the running statistics once, as ``nn.BatchNorm*`` would on the
un-split batch (unbiased variance, ``momentum=None`` as a cumulative average).
"""
from __future__ import annotations

import logging
from typing import Any, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipe.core.checkpoint import is_recomputing
from pipe.core.options import verify_chunks

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "convert_deferred_model", "deferred_batch_norms"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm whose running statistics are updated by :meth:`commit`, once per mini-batch.

    Made by :func:`convert_deferred_batch_norm` from an ``nn.BatchNorm1d/2d/3d``;
    it keeps that layer's parameters and buffers (so ``state_dict()`` keys and
    values are unchanged) and normalises exactly as it would.

    Inside a ``Pipe`` the pipeline commits once the mini-batch has gone
    through. Used on its own, nothing commits unless ``chunks`` is given: then
    the layer commits after every ``chunks`` micro-batches it has seen
    (torchgpipe's behaviour), or call :meth:`commit` yourself.

    Args:
        chunks: commit by itself after this many micro-batches; None (default)
            to leave committing to the ``Pipe`` or the caller. Inside a
            ``Pipe`` it must equal the pipe's ``chunks``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: Optional[int] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = None if chunks is None else verify_chunks(chunks)
        # (elements per channel, mean, biased variance) of each micro-batch seen.
        self._pending: list[tuple[int, Tensor, Tensor]] = []

    @classmethod
    def convert_deferred_batch_norm(cls, module: M, chunks: Optional[int] = None) -> M:
        """torchgpipe's spelling of :func:`convert_deferred_batch_norm`."""
        return convert_deferred_batch_norm(module, chunks)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"BatchNorm expects an input of at least 2 dims (N, C, ...), got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            self._record(input)
            if self.chunks is not None and len(self._pending) >= self.chunks:
                self.commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _record(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        x = input.detach()
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # accumulate half-precision statistics in float32
        with torch.no_grad():
            var, mean = torch.var_mean(x, dim=dims, unbiased=False)
        self._pending.append((input.numel() // input.size(1), mean, var))

    def commit(self) -> None:
        """Updates the running statistics with the micro-batches recorded since the last commit."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        means = torch.stack([m for _, m, _ in pending])            # (micro-batches, C)
        counts = torch.tensor([n for n, _, _ in pending], dtype=means.dtype, device=means.device)
        variances = torch.stack([v for _, _, v in pending])        # (micro-batches, C)
        total = counts.sum()
        weights = (counts / total).unsqueeze(1)
        mean = (weights * means).sum(0)
        # Chan et al.: the spread of the whole is the spread within the pieces
        # plus the spread of the pieces' means.
        biased = (weights * (variances + (means - mean) ** 2)).sum(0)
        n = float(total.item())
        unbiased = biased * (n / (n - 1)) if n > 1 else biased
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    def discard(self) -> None:
        """Forgets the micro-batches recorded since the last commit (a failed step)."""
        self._pending = []


def convert_deferred_batch_norm(module: M, chunks: Optional[int] = None) -> M:
    """Replaces every BatchNorm with running statistics in ``module`` by a :class:`DeferredBatchNorm`.

    The new layers share the old ones' parameters and buffers. Layers are
    replaced in their parents, so ``module`` itself is changed (``Pipe`` owns
    the layers it wraps anyway).

    Usage::

        model = convert_deferred_batch_norm(model)   # Pipe(deferred_batch_norm=True) does this

    Args:
        chunks: for use without a ``Pipe``: the layers commit by themselves
            after every ``chunks`` micro-batches (see :class:`DeferredBatchNorm`).

    Returns:
        ``module``, or the replacement when ``module`` is itself a BatchNorm.

    Raises:
        ValueError: ``module`` holds batch norm captured as graph ops by ``pipe.split``.
    """
    if getattr(module, "captured_batch_norm", False):
        raise ValueError(
            "deferred_batch_norm cannot reach the batch norm captured in the graph of a pipe.split stage; "
            "use chunks=1 (each micro-batch is then the whole batch), or pipeline the BatchNorm layers as "
            "nn.Sequential modules (see docs/split.md)"
        )
    if isinstance(module, _BatchNorm) and not isinstance(module, (DeferredBatchNorm, nn.SyncBatchNorm)) \
            and module.track_running_stats:
        converted = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
        if module.affine:
            converted.register_parameter("weight", module.weight)
            converted.register_parameter("bias", module.bias)
        converted.register_buffer("running_mean", module.running_mean)
        converted.register_buffer("running_var", module.running_var)
        converted.register_buffer("num_batches_tracked", module.num_batches_tracked)
        converted.train(module.training)
        return converted  # type: ignore[return-value]
    for name, child in module.named_children():
        converted_child = convert_deferred_batch_norm(child, chunks)
        if converted_child is not child:
            setattr(module, name, converted_child)
    return module


def convert_deferred_model(model: Any) -> Any:
    """:func:`convert_deferred_batch_norm` for an ``nn.Sequential`` or a layer factory ``factory(index) -> layer``.

    A factory is wrapped so that each layer it makes is converted (``DistributedPipe``
    builds only the layers a rank owns).
    """
    if isinstance(model, nn.Module) or not callable(model):
        return convert_deferred_batch_norm(model)

    def factory(index: int) -> Any:
        layer = model(index)
        return convert_deferred_batch_norm(layer) if isinstance(layer, nn.Module) else layer

    return factory


def deferred_batch_norms(module: nn.Module, chunks: Optional[int] = None) -> list[DeferredBatchNorm]:
    """The :class:`DeferredBatchNorm` layers in ``module``.

    Raises:
        ValueError: with ``chunks`` (a ``Pipe``'s), a layer that commits by itself after another count.
    """
    layers = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
    for layer in layers:
        if chunks is not None and layer.chunks is not None and layer.chunks != chunks:
            raise ValueError(
                f"a DeferredBatchNorm commits by itself after chunks={layer.chunks} micro-batches but the Pipe runs "
                f"chunks={chunks}, so it would update its statistics more than once per mini-batch; build it "
                f"without chunks (the Pipe commits once per mini-batch) or with chunks={chunks}"
            )
    return layers
