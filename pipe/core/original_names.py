"""The plain model's names of a layer's tensors, and the model a stage of ``pipe.split`` was cut from.

A stage of :func:`pipe.split` (:class:`pipe.split_stage.SplitStage`) records,
for each of its parameters and buffers, the names the split model gives the
same tensor (``original_names``: ``"lm_head.weight"`` ->
``["model.embed_tokens.weight", "lm_head.weight"]`` for a tied LLaMA), and
keeps the model itself. The runners read both here, by attribute, so that they
need not import the front end: refusals name tensors as the user's model
does, and a stage built on ``meta`` is initialised by its model's own code
(:mod:`pipe.distributed.materialize`). Any other layer's tensors are named as
the ``nn.Sequential`` names them (``"3.linear.weight"``).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

__all__: list[str] = []

SOURCE = "_source_model"
"""The key of a split stage's ``__dict__`` holding the model it was cut from (not a submodule)."""


def original_names(layer: nn.Module) -> Optional[dict[str, list[str]]]:
    """A split stage's tensor names -> the split model's names for them; None for any other layer."""
    names = layer.__dict__.get("original_names")
    return names if isinstance(names, dict) else None


def source_model(layer: nn.Module) -> Optional[nn.Module]:
    """The model a split stage was cut from (None for any other layer)."""
    model = layer.__dict__.get(SOURCE)
    return model if isinstance(model, nn.Module) else None


def plain_name(layer_name: str, layer: nn.Module, local: str) -> str:
    """The plain model's name of tensor ``local`` of ``layer`` (registered as ``layer_name``).

    A split stage's tensor gets the split model's first name for it (the one
    its ``named_parameters()`` gives); a tensor of any other layer is
    ``"<layer_name>.<local>"``, as the ``nn.Sequential`` names it.
    """
    names = original_names(layer)
    if names and local in names:
        return names[local][0]
    return f"{layer_name}.{local}" if layer_name else local


def partition_name(partition: nn.Module, name: str, module: bool = False) -> str:
    """The plain model's name of ``name`` (a tensor, or a submodule with ``module``) of ``partition``, an
    ``nn.Sequential`` of layers.

    A split stage's tensor gets the split model's name (``0.lm_head.weight`` ->
    ``model.embed_tokens.weight``) and its submodule that module's path
    (``0.model.layers.0`` -> ``model.layers.0``); the stage itself, which the
    model has no module for, keeps its index (``"0"``). Other layers' names are
    the ``nn.Sequential``'s already.
    """
    layer_name, _, local = name.partition(".")
    layer = partition._modules.get(layer_name)
    if not local or layer is None or original_names(layer) is None:
        return name
    return local if module else plain_name(layer_name, layer, local)
