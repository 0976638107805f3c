"""Automatic balancing: how many layers each partition should get.

Usage::

    from pipe.balance import balance_by_time
    balance = balance_by_time(4, model, sample, timeout=3)
    model = Pipe(model, balance=balance, chunks=8)

Each helper measures a cost per layer (:mod:`pipe.balance.timing`, :mod:`pipe.balance.profile`) and
cuts the layers so that the costliest partition is as cheap as possible
(:mod:`pipe.balance.solver`). :func:`traced_step` reads what each stage cost in a recorded step
(:mod:`pipe.balance.traced`), for :func:`pipe.plan.auto_schedule` to cut and order by.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from pipe.balance.profile import profile_params, profile_sizes
from pipe.balance.timing import LayerTimes, profile_times, time_layers
from pipe.balance.solver import solve
from pipe.balance.traced import CostError, TracedStep, traced_step
from pipe.core.options import is_int, positive_int
from pipe.core.partition import verify_module

__all__ = ["balance_by_time", "balance_by_size", "balance_by_params", "balance_cost", "time_layers", "LayerTimes",
           "traced_step", "TracedStep", "CostError"]

Device = Union[torch.device, int, str]


def balance_cost(cost: Sequence[float], partitions: int) -> list[int]:
    """A balance for ``Pipe`` from a cost per layer: the largest partition cost is minimal.

    Usage::

        balance_cost([1, 1, 8, 1, 1], 3)   # [2, 1, 2]
    """
    return solve(cost, partitions)


def balance_by_time(partitions: int, module: nn.Sequential, sample: Any, *, timeout: float = 1.0,
                    device: Optional[Device] = None) -> list[int]:
    """Balances by the measured time of each layer's forward and backward.

    Usage::

        balance = balance_by_time(2, model, torch.randn(64, 3, 32, 32), timeout=2)

    Args:
        partitions: how many partitions.
        module: the ``nn.Sequential`` to balance (left untouched: layers are copied).
        sample: an input mini-batch, or a micro-batch; what matters is that
            layer times are proportional to those in training.
        timeout: seconds to keep profiling (more rounds, less noise); at
            least one round runs.
        device: where to profile, e.g. ``"cuda:0"`` (default: the first CUDA
            device, or the CPU when there is none, as ``Pipe``).

    Returns:
        Layers per partition.

    Raises:
        TypeError, ValueError: a bad argument (see the message).
    """
    _verify(partitions, module)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    times = profile_times(module, sample, float(timeout), _device(device), window=-(-len(module) // partitions))
    return solve(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, sample: Any, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Optional[Device] = None) -> list[int]:
    """Balances by memory: activations kept for backward plus parameters, on CPU or CUDA.

    Usage::

        balance = balance_by_size(2, model, torch.randn(64, 3, 32, 32), chunks=8, param_scale=4.0)

    Args:
        partitions: how many partitions.
        module: the ``nn.Sequential`` to balance (left untouched: layers are copied).
        sample: an input mini-batch; activations are measured on its first
            micro-batch.
        chunks: the ``chunks`` the ``Pipe`` will use.
        param_scale: copies of the parameters training keeps per parameter:
            about 2 for SGD (weights and gradients), 3 with momentum, 4 for Adam.
        device: where to profile (default: as for :func:`balance_by_time`).

    Returns:
        Layers per partition.

    Raises:
        TypeError, ValueError: a bad argument (see the message).
    """
    _verify(partitions, module)
    positive_int("chunks", chunks, "the Pipe's chunks")
    if not isinstance(param_scale, (int, float)) or not (math.isfinite(param_scale) and param_scale >= 0):
        raise ValueError(
            f"param_scale must be a non-negative number, got {param_scale!r} "
            "(about 2 for SGD, 3 for SGD with momentum, 4 for Adam)"
        )
    sizes = profile_sizes(module, sample, chunks, float(param_scale), _device(device))
    return solve(sizes, partitions)


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """Balances by the number of parameters of each layer (no input needed, nothing runs).

    Usage::

        balance = balance_by_params(4, model)
    """
    _verify(partitions, module)
    return solve(profile_params(module), partitions)


def _verify(partitions: Any, module: nn.Sequential) -> None:
    verify_module(module)
    if not is_int(partitions):
        raise TypeError(f"partitions must be an int, got {partitions!r}")
    if not 1 <= partitions <= len(module):
        raise ValueError(
            f"cannot split {len(module)} layers into {partitions} partitions; "
            f"partitions must be between 1 and {len(module)}"
        )


def _device(device: Optional[Device]) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)
