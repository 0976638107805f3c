"""``PipeSequential``: an ``nn.Sequential`` with the calling convention of torch's pipeline ``Pipe``.

``torch.distributed.pipeline.sync.Pipe`` (PyTorch 1.8-2.3) passed
``model(a, b, c)`` to the first layer as three arguments and, when a layer
returned a tuple, unpacked it into the next layer's arguments. A plain
``nn.Sequential`` passes one value from layer to layer. ``PipeSequential`` is
the plain module with the first rule, so it is its own oracle: what
``Pipe(PipeSequential(...))`` computes must equal what ``PipeSequential(...)``
computes. A list (or any non-tuple) stays one value.

The convention is carried by the container's type and nothing else: ``Pipe``,
``DistributedPipe`` and the balancers cut the model into containers made by
:func:`sequential_like`, so a partition (or a stage, or a profiled layer) of a
``PipeSequential`` is a ``PipeSequential`` and a value crossing a partition
boundary is handed over exactly as between two layers of the whole model.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from torch import nn

__all__: list[str] = []


def call_layer(layer: nn.Module, value: Any, unpack: bool) -> Any:
    """Applies ``layer`` to ``value``; with ``unpack``, a tuple becomes the layer's arguments."""
    if unpack and isinstance(value, tuple):
        return layer(*value)
    return layer(value)


class PipeSequential(nn.Sequential):
    """Layers in order; a tuple returned by one layer is the next layer's arguments.

    Example::

        model = PipeSequential(Embed(), Block(), Block(), Head())   # Block.forward(self, x, mask)
        out = model(tokens, mask)                 # Embed(tokens, mask) -> (x, mask) -> Block(x, mask) ...
    """

    def forward(self, *inputs: Any) -> Any:
        value: Any = inputs if len(inputs) != 1 else inputs[0]
        for layer in self:
            value = call_layer(layer, value, unpack=True)
        return value


def sequential_like(model: object, layers: Iterable[tuple[str, nn.Module]]) -> nn.Sequential:
    """A slice of ``model``: ``layers`` (name, layer) in a container with ``model``'s calling convention.

    A ``PipeSequential`` gives a ``PipeSequential``; anything else (an
    ``nn.Sequential``, a layer factory) an ``nn.Sequential``: one value from
    layer to layer.

    Usage::

        first_half = sequential_like(model, list(model.named_children())[:2])
    """
    container = PipeSequential if isinstance(model, PipeSequential) else nn.Sequential
    return container(OrderedDict(layers))
