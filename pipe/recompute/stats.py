"""Running statistics under recomputation: updated by the forward, not again by its replay.

A train-mode batch norm updates its running mean, variance and
``num_batches_tracked`` in place on every call. A recompute policy replays
the layer's forward in backward, which would update them a second time
(``num_batches_tracked`` 2 per step where the plain model has 1, and the
running estimates moved twice). This is the rule ``torch.utils.checkpoint``
users apply by hand and :mod:`pipe.batchnorm` applies to ``Pipe``'s own
checkpointing (statistics are not updated while recomputing): during a
replay, every train-mode batch norm of the layer runs on scratch copies of its
buffers, which are dropped afterwards. The replay runs the very same
operations on the same inputs, so its outputs (normalised with the batch's
statistics, as in training) equal the forward's; only the scratch buffers
see the second update.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes

__all__: list[str] = []

RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextmanager
def scratch_running_stats(module: Optional[nn.Module]) -> Iterator[None]:
    """Inside, the train-mode batch norms of ``module`` update copies of their running statistics."""
    if module is None:
        yield
        return
    swapped: list[tuple[nn.Module, str, Tensor]] = []
    try:
        for sub in module.modules():
            if isinstance(sub, _NormBase) and sub.training and sub.track_running_stats:
                for name in RUNNING_STATS:
                    buffer = sub._buffers.get(name)
                    if buffer is not None:
                        swapped.append((sub, name, buffer))
                        # Outside the replay's dispatch modes: the copy is no operation of the layer.
                        with _disable_current_modes():
                            sub._buffers[name] = buffer.clone()
        yield
    finally:
        for sub, name, buffer in swapped:
            sub._buffers[name] = buffer
