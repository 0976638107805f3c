"""Tied parameters across partitions: one weight used by two partitions (the embedding and the LM head).

A language model's input embedding and output projection are often one
tensor. Cut into partitions, both partitions hold it:

* on one device the partitions simply share the parameter object; autograd
  sums both partitions' gradients into its ``.grad``, as in the plain model;
* on different devices the first partition holding it keeps the parameter
  (its home); every other partition gets a differentiable copy of it on its
  own device at each forward (``weight.to(device)``), so the gradient flows
  back through the copy into the one parameter. There is one weight, one
  gradient and one optimizer entry, and the state dict has the plain model's
  keys (each name of the tied weight once), as in the plain model.

Between the processes of ``DistributedPipe`` a copy per forward would cost a
transfer per micro-batch; there each holding rank keeps a replica instead and
the replicas' gradients are summed (:mod:`pipe.distributed.tied_replicas`), the way
DeepSpeed's ``TiedLayerSpec`` and Megatron's embedding group do.

Buffers shared between partitions on different devices are refused: an
in-place update on one device could not reach the other.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class Tie:
    """A tensor held by more than one partition.

    Attributes:
        tensor: the parameter or buffer.
        is_buffer: whether it is a buffer.
        uses: ``(partition, module, attribute, qualified name)`` for every place it is registered.
    """

    tensor: torch.Tensor
    is_buffer: bool
    uses: list[tuple[int, nn.Module, str, str]] = field(default_factory=list)

    @property
    def partitions(self) -> list[int]:
        """The partitions holding the tensor, in order."""
        return sorted({j for j, _, _, _ in self.uses})

    def name(self, partition: int) -> str:
        """The tensor's qualified name in ``partition``."""
        return next(name for j, _, _, name in self.uses if j == partition)


def find_ties(partitions: Sequence[nn.Module]) -> list[Tie]:
    """The parameters and buffers registered in more than one partition, in order of first use."""
    found: dict[int, Tie] = {}
    for j, partition in enumerate(partitions):
        for module_name, module in partition.named_modules(remove_duplicate=False):
            for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
                for attr, tensor in tensors.items():
                    if tensor is None:
                        continue
                    tie = found.setdefault(id(tensor), Tie(tensor, kind == "buffer"))
                    tie.uses.append((j, module, attr, f"{module_name}.{attr}" if module_name else attr))
    return [tie for tie in found.values() if len(tie.partitions) > 1]


def tie_partitions(partitions: Sequence[nn.Module], devices: Sequence[torch.device]) -> list[Tie]:
    """Lets partitions share tensors: on one device as they are, across devices by a copy per forward.

    Call after the partitions were moved to ``devices`` (the last move of a
    shared tensor wins; this puts it back on its home, the first partition
    holding it).

    Returns:
        The ties found.

    Raises:
        ValueError: a buffer shared by partitions on different devices.
    """
    ties = find_ties(partitions)
    for tie in ties:
        holders = tie.partitions
        home = holders[0]
        away = [j for j in holders if devices[j] != devices[home]]
        if not away:
            logger.info("partitions %s share %r on %s", holders, tie.name(home), devices[home])
            continue
        if tie.is_buffer:
            raise ValueError(
                f"buffer {tie.name(home)!r} of partition {home} ({devices[home]}) is also "
                f"{tie.name(away[0])!r} in partition {away[0]} ({devices[away[0]]}); a buffer cannot be shared "
                "across devices (its in-place updates would not reach the other copy): give the layers "
                "separate buffers, or balance them onto one device"
            )
        tie.tensor.data = tie.tensor.data.to(devices[home])
        for j in away:
            places = [(module, attr) for k, module, attr, _ in tie.uses if k == j]
            for module, attr in places:
                del module._parameters[attr]
            partitions[j].register_forward_pre_hook(_CopyOnForward(tie.tensor, places, devices[j]))
            # The state dict still lists the tensor under this partition's names, as the plain model's does.
            # (on the layer: Pipe lists the layers, not the partitions, as its children)
            for name in (name for k, _, _, name in tie.uses if k == j):
                layer_name, _, key = name.partition(".")
                owner = partitions[j].get_submodule(layer_name) if key else partitions[j]
                _keep_in_state_dict(owner, key or name, tie.tensor)
        logger.info("partition %d holds %r; partitions %s use a copy of it on their devices",
                    home, tie.name(home), away)
    return ties


def _keep_in_state_dict(module: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """``module``'s state dict lists ``tensor`` under ``key`` (the home's value); loading skips the key."""

    def add(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        state[prefix + key] = tensor.detach()

    def skip(state: dict[str, Any], prefix: str, *args: Any) -> None:
        state.pop(prefix + key, None)

    module._register_state_dict_hook(add)
    module._register_load_state_dict_pre_hook(skip)


class _CopyOnForward:
    """Before a partition's forward: a differentiable copy of the home parameter on the partition's device."""

    def __init__(self, parameter: torch.Tensor, places: list[tuple[nn.Module, str]], device: torch.device) -> None:
        self.parameter = parameter
        self.places = places
        self.device = device

    def __call__(self, partition: nn.Module, args: Any) -> None:
        copy = self.parameter.to(self.device)
        for module, attr in self.places:
            setattr(module, attr, copy)
