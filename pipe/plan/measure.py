"""Measurement: what a plan really costs on this rank, to check a prediction against.

Run inside each rank of a ``DistributedPipe``: a first step warms up and
allocates the gradients; then one step is timed and its activation bytes
counted with :class:`pipe.recompute.ActivationMemory` (the rank's forwards and
backwards run on its main thread, so every storage they create is counted).
The static part (parameters, gradients, optimiser state) is the same formula
on both sides, so the comparison is on the activations::

    from pipe.plan.measure import measure_step
    measured = measure_step(model, x, y, loss_fn)
    measured.activation_peak        # counted bytes, this rank
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pipe.recompute.memory import ActivationMemory

__all__ = ["Measured", "measure_step"]


@dataclass(frozen=True)
class Measured:
    """One rank's measured step: counted activation peak (bytes) and wall time (seconds)."""

    activation_peak: int
    step_time: float


def measure_step(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable[..., Any],
                 repeat: int = 3) -> Measured:
    """Counts and times ``model.step(inputs, target, loss_fn)`` on this rank (every rank must call it).

    The step time is the fastest of ``repeat`` steps; the peak is that of the first counted step.
    """
    step = getattr(model, "step", None)
    if step is None:
        raise TypeError(f"measure_step needs a DistributedPipe (a model with step()), got {type(model).__name__}")
    step(inputs, target, loss_fn)  # warm-up; allocates .grad
    for param in model.parameters():
        if param.grad is not None:
            param.grad.zero_()
    with ActivationMemory() as counter:
        step(inputs, target, loss_fn)
        peak = counter.peak_bytes
    times = []
    for _ in range(repeat):
        begun = time.perf_counter()
        step(inputs, target, loss_fn)
        times.append(time.perf_counter() - begun)
    torch.distributed.barrier()
    return Measured(peak, min(times))
