"""Stages: the layers of one rank, cut from the model without materialising the rest.

Every rank describes the same model, either as an ``nn.Sequential`` (possibly
built on the ``meta`` device, which costs no memory) or as a layer factory
``factory(index) -> nn.Module``. A rank keeps the stages the schedule gives it
(:meth:`pipe.core.schedule.Schedule.stages_of`) and materialises only those layers
on its device (a layer built on ``meta`` is allocated there and initialised by
known code, or refused: :mod:`pipe.distributed.materialize`); the others stay
on ``meta`` (factory) or where the user left them. Layers keep their names in
the original ``nn.Sequential``, so state-dict keys are the original model's on
every rank.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from pipe.core.partition import verify_balance, verify_module
from pipe.core.schedule import Schedule
from pipe.core.sequential import sequential_like
from pipe.distributed.materialize import materialize, refusal
from pipe.core.original_names import original_names

__all__: list[str] = []

logger = logging.getLogger(__name__)

LayerFactory = Callable[[int], nn.Module]
ModelSpec = Union[nn.Sequential, LayerFactory]


def even_balance(layers: int, stages: int, model: object = None, schedule: Optional[Schedule] = None
                 ) -> list[int]:
    """Layers per stage, as equal as possible, the first stages taking the remainder.

    Args:
        layers: how many layers the model has.
        stages: how many stages the pipeline has.
        model: the model, to advise on a refusal (a model cut by :func:`pipe.split` needs more cut points).
        schedule: the pipeline's schedule, to say where its stage count comes from.

    Raises:
        ValueError: fewer layers than stages.
    """
    if layers < stages:
        where = ""
        if schedule is not None and getattr(schedule, "virtual_stages", None) is not None:
            per_rank = f"{schedule.virtual_stages} stage{'s' if schedule.virtual_stages > 1 else ''} per rank"
            if getattr(schedule, "kind", None) == "zbv":
                per_rank += ", in a V"
            where = f" ({schedule.ranks} pipeline ranks x {per_rank})"
        if _is_split(model):
            raise ValueError(
                f"the model has {layers} pieces (pipe.split with {layers - 1} cut point{'s' if layers != 2 else ''}) "
                f"but the pipeline has "
                f"{stages} stages{where}; every stage needs a piece: give pipe.split at least {stages - 1} cut "
                f"points (at=[...], e.g. one per block: at=['model.layers.1', 'model.layers.2', ...]), or use "
                f"fewer pipeline ranks or stages per rank"
            )
        raise ValueError(
            f"the model has {layers} layers but the pipeline has {stages} stages{where}; every stage needs a layer "
            f"(use fewer ranks or virtual_stages, or split layers into smaller nn.Sequential entries)"
        )
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _is_split(model: object) -> bool:
    return isinstance(model, nn.Sequential) and len(model) > 0 and all(original_names(layer) is not None
                                                                       for layer in model)


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


def build_stages(
    model: ModelSpec,
    layers: int,
    balance: Sequence[int],
    schedule: Schedule,
    rank: int,
    device: torch.device,
    agree: Callable[[list[str]], list[str]] = lambda names: names,
    initialise: bool = True,
) -> tuple[dict[int, nn.Sequential], list[nn.Sequential]]:
    """The stages ``rank`` runs, on ``device``, and a skeleton of every stage.

    Args:
        model: an ``nn.Sequential`` or a layer factory.
        layers: the number of layers (``layer_count``).
        balance: layers per stage; one entry per stage of ``schedule``.
        schedule: says which stages ``rank`` owns.
        rank: the pipeline rank.
        device: where owned layers go. Tensors on ``meta`` are allocated there
            and initialised (:mod:`pipe.distributed.materialize`).
        agree: gathers every rank's uninitialised tensors (so that all refuse
            together); default: this rank's alone.
        initialise: False: the parameters and persistent buffers built on
            ``meta`` stay there, to be sharded, then allocated for a load
            (``materialize(initialise=False)``).

    Returns:
        ``(owned, skeleton)``: ``owned[stage]`` is an ``nn.Sequential`` of the
        stage's layers under their original names (a ``PipeSequential`` when
        ``model`` is one; a factory's stages are ``nn.Sequential``); ``skeleton`` holds every
        stage, with layers of other ranks left where they were (a factory
        builds them on ``meta``), to read skip declarations from.

    Raises:
        ValueError: ``balance`` does not fit the model or the schedule, or a
            tensor built on ``meta`` has nothing to initialise it (naming it).
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
    built: list[tuple[str, nn.Module]] = []
    stage_of: list[int] = []
    owned_layers: list[int] = []
    start = 0
    for stage, size in enumerate(balance):
        for index in range(start, start + size):
            if stage in mine or isinstance(model, nn.Sequential):
                layer = _build_layer(model, index)
            else:
                with torch.device("meta"):
                    layer = _build_layer(model, index)
            if stage in mine:
                owned_layers.append(index)
            built.append((names[index], layer))
            stage_of.append(stage)
        start += size
    unset = agree(materialize(built, owned_layers, device, initialise))
    message = refusal(unset)
    if message is not None:
        raise ValueError(message)
    owned: dict[int, nn.Sequential] = {}
    skeleton: list[nn.Sequential] = []
    for stage in range(len(balance)):
        entries = [entry for entry, s in zip(built, stage_of) if s == stage]
        partition = sequential_like(model, entries)  # a PipeSequential's stages keep its calling convention
        skeleton.append(partition)
        if stage in mine:
            owned[stage] = partition
    logger.info("rank %d owns stages %s (balance %s) on %s", rank, sorted(owned), balance, device)
    return owned, skeleton
