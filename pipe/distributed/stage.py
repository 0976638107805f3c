"""Stages: the layers of one rank, cut from the model without materialising the rest.

Every rank describes the same model, either as an ``nn.Sequential`` (possibly
built on the ``meta`` device, which costs no memory) or as a layer factory
``factory(index) -> nn.Module``. A rank keeps the stages the schedule gives it
(:meth:`pipe.core.schedule.Schedule.stages_of`) and materialises only those layers
on its device; the others stay on ``meta`` (factory) or where the user left
them. Layers keep their names in the original ``nn.Sequential``, so state-dict
keys are the original model's on every rank.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from pipe.core.partition import verify_balance, verify_module
from pipe.core.schedule import Schedule
from pipe.core.sequential import sequential_like

__all__: list[str] = []

logger = logging.getLogger(__name__)

LayerFactory = Callable[[int], nn.Module]
ModelSpec = Union[nn.Sequential, LayerFactory]


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as equal as possible, the first stages taking the remainder.

    Raises:
        ValueError: fewer layers than stages.
    """
    if layers < stages:
        raise ValueError(
            f"the model has {layers} layers but the pipeline has {stages} stages; every stage needs a layer "
            f"(use fewer ranks or virtual_stages, or split layers into smaller nn.Sequential entries)"
        )
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def layer_count(model: ModelSpec, layers: Optional[int]) -> int:
    """How many layers ``model`` has: ``len`` of a Sequential, ``layers`` for a factory.

    Raises:
        TypeError, ValueError: a factory without ``layers``, or a Sequential with a different ``layers``.
    """
    if isinstance(model, nn.Sequential):
        verify_module(model)
        if layers is not None and layers != len(model):
            raise ValueError(f"layers={layers} but the nn.Sequential has {len(model)}; omit layers= for a Sequential")
        return len(model)
    if isinstance(model, nn.Module) or not callable(model):
        raise TypeError(
            f"the model must be an nn.Sequential or a layer factory (a callable index -> nn.Module), "
            f"got {type(model).__name__}; wrap your layers in nn.Sequential(...)"
        )
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(
            f"a layer factory needs layers= (how many layers the model has, a positive int), got {layers!r}"
        )
    return layers


def layer_names(model: ModelSpec, layers: int) -> list[str]:
    """The layers' names: the Sequential's keys, or ``"0" .. "layers-1"`` for a factory."""
    if isinstance(model, nn.Sequential):
        return list(model._modules.keys())
    return [str(i) for i in range(layers)]


def _build_layer(model: ModelSpec, index: int) -> nn.Module:
    if isinstance(model, nn.Sequential):
        return model[index]
    layer = model(index)
    if not isinstance(layer, nn.Module):
        raise TypeError(f"the layer factory returned {type(layer).__name__} for layer {index}; it must return an nn.Module")
    return layer


def _materialize(layer: nn.Module, device: torch.device) -> nn.Module:
    """Moves ``layer`` to ``device``; a layer on ``meta`` is allocated there and reset."""
    on_meta = any(t.is_meta for t in list(layer.parameters()) + list(layer.buffers()))
    if not on_meta:
        return layer.to(device)
    layer.to_empty(device=device)
    for module in layer.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return layer


def build_stages(
    model: ModelSpec,
    layers: int,
    balance: Sequence[int],
    schedule: Schedule,
    rank: int,
    device: torch.device,
) -> tuple[dict[int, nn.Sequential], list[nn.Sequential]]:
    """The stages ``rank`` runs, on ``device``, and a skeleton of every stage.

    Args:
        model: an ``nn.Sequential`` or a layer factory.
        layers: the number of layers (``layer_count``).
        balance: layers per stage; one entry per stage of ``schedule``.
        schedule: says which stages ``rank`` owns.
        rank: the pipeline rank.
        device: where owned layers go.

    Returns:
        ``(owned, skeleton)``: ``owned[stage]`` is an ``nn.Sequential`` of the
        stage's layers under their original names (a ``PipeSequential`` when
        ``model`` is one; a factory's stages are ``nn.Sequential``); ``skeleton`` holds every
        stage, with layers of other ranks left where they were (a factory
        builds them on ``meta``), to read skip declarations from.

    Raises:
        ValueError: ``balance`` does not fit the model or the schedule.
    """
    balance = verify_balance(balance, layers)
    if len(balance) != schedule.stages:
        raise ValueError(
            f"balance {balance} has {len(balance)} stages but the schedule has {schedule.stages} "
            f"({schedule.ranks} pipeline ranks x virtual_stages={schedule.virtual_stages}); "
            f"give one entry per stage"
        )
    names = layer_names(model, layers)
    mine = set(schedule.stages_of(rank))
    owned: dict[int, nn.Sequential] = {}
    skeleton: list[nn.Sequential] = []
    start = 0
    for stage, size in enumerate(balance):
        entries = []
        for index in range(start, start + size):
            if stage in mine:
                layer = _materialize(_build_layer(model, index), device)
            elif isinstance(model, nn.Sequential):
                layer = model[index]
            else:
                with torch.device("meta"):
                    layer = _build_layer(model, index)
            entries.append((names[index], layer))
        partition = sequential_like(model, entries)  # a PipeSequential's stages keep its calling convention
        skeleton.append(partition)
        if stage in mine:
            owned[stage] = partition
        start += size
    logger.info("rank %d owns stages %s (balance %s) on %s", rank, sorted(owned), balance, device)
    return owned, skeleton
