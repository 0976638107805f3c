"""Partitions: cut an ``nn.Sequential`` into consecutive runs of layers and place them.

With a balance (layers per partition) each partition goes to its device; without
one, partitions follow where the user put the layers. Everything a user can get
wrong here is checked with a message that names the values and the fix.
"""
from __future__ import annotations

import itertools
import logging
from typing import Optional, Sequence, Union

import torch
from torch import nn

from pipe.core.sequential import sequential_like
from pipe.core.tying import tie_partitions

__all__: list[str] = []

logger = logging.getLogger(__name__)

Device = Union[torch.device, int, str]

_BALANCE_HELP = "pipe.balance.balance_by_time or balance_by_size can compute one"


def verify_module(module: nn.Module) -> None:
    """Checks that ``module`` is an ``nn.Sequential`` with each layer once."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"Pipe takes an nn.Sequential, got {type(module).__name__}; "
            "wrap your layers in nn.Sequential(...) in the order they run"
        )
    seen: dict[int, str] = {}
    for name, layer in module._modules.items():
        if layer is None:
            raise TypeError(f"layer {name!r} of the module is None; remove it from the nn.Sequential")
        if id(layer) in seen:
            raise ValueError(
                f"layers {seen[id(layer)]!r} and {name!r} are the same module object; a layer can appear once "
                "in a Pipe (use copy.deepcopy for a second, independent layer)"
            )
        seen[id(layer)] = name


def default_devices(partitions: int) -> list[torch.device]:
    """The visible CUDA devices, or the CPU once per partition when there is none."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * partitions


def _normalize_device(device: Device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def verify_balance(balance: Sequence[int], layers: int) -> list[int]:
    """Checks that ``balance`` (layers per partition) covers ``layers`` layers, each partition non-empty."""
    if isinstance(balance, (int, str)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise TypeError(f"balance must be a list of ints (layers per partition), got {balance!r}")
    balance = list(balance)
    if not balance and layers == 0:
        return balance  # an empty model has no partitions (and Pipe returns its input, as nn.Sequential() does)
    if not balance:
        raise ValueError(f"balance is empty; give at least one partition, e.g. balance=[{layers}]")
    if sum(balance) != layers:
        raise ValueError(
            f"balance {balance} covers {sum(balance)} layers but the module has {layers}; "
            f"balance must sum to len(module) ({_BALANCE_HELP})"
        )
    if any(b < 1 for b in balance):
        raise ValueError(
            f"balance {balance} has a partition with fewer than 1 layer; every partition needs at least one ({_BALANCE_HELP})"
        )
    return balance


def _layer_device(layer: nn.Module) -> Optional[torch.device]:
    for tensor in itertools.chain(layer.parameters(), layer.buffers()):
        return tensor.device
    return None


def split_module(
    module: nn.Sequential,
    balance: Optional[Sequence[int]] = None,
    devices: Optional[Sequence[Device]] = None,
) -> tuple[list[nn.Sequential], list[int], list[torch.device]]:
    """Cuts ``module`` into partitions and places them.

    Args:
        module: the model.
        balance: layers per partition; None to follow the layers' placement.
        devices: a device per partition (with ``balance``); default
            :func:`default_devices`.

    Returns:
        ``(partitions, balance, devices)``; partitions hold the original layers
        under their original names, in a container with ``module``'s calling
        convention (:func:`pipe.core.sequential.sequential_like`).

    Raises:
        TypeError, ValueError, IndexError: see the messages.
    """
    verify_module(module)
    names = list(module._modules.keys())
    layers = list(module._modules.values())
    if balance is None:
        if devices is not None:
            raise ValueError(
                f"devices={list(devices)} was given without balance; pass balance (layers per partition) "
                f"to place partitions on devices ({_BALANCE_HELP}), or place the layers yourself and omit both"
            )
        balance, placed = _balance_from_placement(layers)
    else:
        balance = verify_balance(balance, len(module))
        if devices is None:
            placed = default_devices(len(balance))
        else:
            placed = [_normalize_device(d) for d in devices]
        if len(balance) > len(placed):
            raise IndexError(
                f"balance {balance} has {len(balance)} partitions but only {len(placed)} devices {[str(d) for d in placed]} "
                "were given; pass one device per partition (the CPU may repeat: devices=['cpu', 'cpu'])"
            )
        placed = placed[: len(balance)]
        _verify_devices(placed)

    partitions = []
    start = 0
    for size, device in zip(balance, placed):
        # A PipeSequential's partitions are PipeSequentials: the calling convention crosses the cut.
        partition = sequential_like(module, zip(names[start:start + size], layers[start:start + size]))
        partition.to(device)
        partitions.append(partition)
        start += size
    tie_partitions(partitions, placed)  # tied weights: shared on one device, copied across devices
    return partitions, list(balance), list(placed)


def _verify_devices(devices: Sequence[torch.device]) -> None:
    """Checks that every CUDA device exists, before anything is moved there."""
    for device in devices:
        if device.type != "cuda":
            continue
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device} was given but CUDA is not available here (torch.cuda.is_available() is False, "
                f"torch {torch.__version__}); pass devices=['cpu', ...] (one per partition), or install a CUDA "
                "build of PyTorch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device} was given but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                "pass devices among " + str([f"cuda:{k}" for k in range(torch.cuda.device_count())])
            )


def _balance_from_placement(layers: list[nn.Module]) -> tuple[list[int], list[torch.device]]:
    balance: list[int] = []
    devices: list[torch.device] = []
    for layer in layers:
        device = _layer_device(layer)
        if devices and (device is None or device == devices[-1]):
            balance[-1] += 1
            continue
        if device is None:
            device = torch.device("cpu")
        balance.append(1)
        devices.append(device)
    return balance, devices
