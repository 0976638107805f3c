"""Where to cut a model for ``pipe.split(..., at="auto", stages=N)``: by the FLOPs each layer computes.

A HuggingFace decoder is an embedding, ``num_hidden_layers`` alike layers and
a head; the head's vocabulary projection can cost as much as several layers,
so an even split of the layers leaves the last stage the slowest. This counts
each layer's forward FLOPs with torch's ``FlopCounterMode`` on the example
batch (on fake tensors: nothing is computed, allocated or timed; a model on ``meta`` too), adds what runs before
the first layer (the embedding, the rotary tables, the mask) to the first and
what runs after the last (the final norm, the head) to the last, and cuts
where the costliest stage is cheapest (:func:`pipe.balance.solver.solve`).

FLOPs, not times: every rank computes the same cut without exchanging a
thing (timings differ from rank to rank), and a model built on ``meta`` is
costed without being allocated. A backward costs about twice its forward for
every layer alike, so forward FLOPs order the stages as the training step does.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from pipe.balance.solver import solve

__all__: list[str] = []

logger = logging.getLogger(__name__)


def layer_flops(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], layers: list[str]) -> list[float]:
    """The forward FLOPs of each of ``layers`` (module paths, in the order they run), the first counting what
    runs before it and the last what runs after it.

    Raises:
        ValueError: a layer does not run exactly once in the forward.
    """
    counter = FlopCounterMode(display=False)
    marks: dict[str, list[int]] = {path: [] for path in layers}
    handles = []
    for path in layers:
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(
            lambda m, a, path=path: marks[path].append(counter.get_total_flops())))
        handles.append(module.register_forward_hook(
            lambda m, a, o, path=path: marks[path].append(counter.get_total_flops())))
    try:
        # Fake tensors: nothing computed or allocated, and the model's data-dependent checks (HF's packed-sequence
        # mask reads position ids) take the path they take under torch.export.
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
            args, kwargs = tree_map_only(torch.Tensor, fake.from_tensor, (args, kwargs))
            with counter:
                model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    total = counter.get_total_flops()
    for path, seen in marks.items():
        if len(seen) != 2:
            raise ValueError(f"pipe.split(at='auto'): layer {path} ran {len(seen) // 2} times in the model's "
                             f"forward, not once; give the cut by name, at=[...]")
    costs = [float(marks[path][1] - marks[path][0]) for path in layers]
    costs[0] += marks[layers[0]][0]  # the embedding, the rotary tables, the mask
    costs[-1] += total - marks[layers[-1]][1]  # the final norm and the head
    return costs


def auto_cut(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], stages: int,
             layers: list[str]) -> list[str]:
    """The paths to cut ``model`` before into ``stages`` stages of layers whose largest FLOPs are smallest.

    Raises:
        ValueError: fewer layers than stages.
    """
    if len(layers) < stages:
        raise ValueError(f"pipe.split(at='auto', stages={stages}): the model has {len(layers)} layers to cut "
                         f"between ({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}); give stages <= "
                         f"{len(layers)}")
    costs = layer_flops(model, args, kwargs, layers)
    balance = solve(costs, stages)
    starts, at = 0, []
    for count in balance[:-1]:
        starts += count
        at.append(layers[starts])
    sums, first = [], 0
    for count in balance:
        sums.append(sum(costs[first:first + count]))
        first += count
    logger.info("pipe.split(at='auto'): cut before %s; GFLOPs per stage %s (layers per stage %s)", at,
                [round(s / 1e9, 3) for s in sums], balance)
    return at
