"""Putting a recompute strategy on layers: by itself, under ``Pipe``, or on one rank's stages.

:func:`apply_strategy` is the stage-agnostic step both front ends share;
:func:`apply_recompute_config` reads a config and applies it to a model;
:func:`attach_to_pipeline` does that for ``Pipe``'s partitions and wires the
offload of the inputs kept at partition boundaries.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import nn

from pipe.core.options import is_int
from pipe.recompute.config import ConfigSource, parse_config
from pipe.recompute.module import FullRecompute, mark
from pipe.recompute.offload import OffloadLayer, Offloader
from pipe.recompute.selective import SelectiveRecompute, Usage
from pipe.recompute.strategy import RecomputeStrategy

__all__: list[str] = []

logger = logging.getLogger(__name__)


def _layers_of(model: Any) -> tuple[list[nn.Module], list[str], Optional[list[int]]]:
    if isinstance(model, nn.Sequential):
        return list(model), list(model._modules.keys()), None
    if isinstance(model, (list, tuple)) and model and all(isinstance(p, nn.Sequential) for p in model):
        layers, names = [], []
        for partition in model:
            layers += list(partition)
            names += list(partition._modules.keys())
        return layers, names, [len(p) for p in model]
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return list(model), [str(i) for i in range(len(model))], None
    raise TypeError("apply_recompute_config takes an nn.Sequential, a list of layers or a list of "
                    f"nn.Sequential partitions, got {type(model).__name__}")


def apply_recompute_config(model: Any, config: ConfigSource, stages: Optional[Sequence[int]] = None
                           ) -> RecomputeStrategy:
    """Puts the policies of a recompute/swap config on the layers of a model; returns the strategy.

    Usage::

        strategy = apply_recompute_config(model, "examples/recompute.yaml", stages=[4, 4])
        loss = model(x).sum(); loss.backward()     # same gradients, less memory

    Previous marks on the layers are replaced. The normalised strategy is
    logged at INFO.

    Args:
        model: an ``nn.Sequential`` (its children are the layers), a list of
            layers, or a list of ``nn.Sequential`` partitions (one per stage).
        config: see :func:`parse_config`.
        stages: layers per stage; default: the partitions' lengths, or one
            stage holding every layer.

    Raises:
        ValueError / TypeError: a bad config, or ``stages`` not summing to the
            number of layers.
    """
    layers, names, inferred = _layers_of(model)
    if stages is None:
        stages = inferred if inferred is not None else [len(layers)]
    stages = list(stages)
    if sum(stages) != len(layers) or any(not is_int(s) for s in stages):
        raise ValueError(f"stages {stages} cover {sum(stages)} layers but the model has {len(layers)}; "
                         "give the number of layers of each stage (Pipe's balance)")
    strategy = parse_config(config, stages, names)
    apply_strategy(strategy, dict(enumerate(layers)))
    strategy.log()
    return strategy


def apply_strategy(strategy: RecomputeStrategy, layers: Mapping[int, nn.Module],
                   offloader: Optional[Callable[[int, int], Offloader]] = None) -> None:
    """Puts a parsed strategy's policies on the layers given, by layer index; the others are left alone.

    The stage-agnostic half of :func:`apply_recompute_config`, which both
    front ends call: ``Pipe`` gives every layer, a ``DistributedPipe`` rank
    the layers of its own stages. The stages of the layers given get their
    offloaders (``strategy.offloaders``, ``strategy.checkpoint_offloaders``).

    Args:
        strategy: from :func:`parse_config`.
        layers: the layers to mark, by their index in the model.
        offloader: ``offloader(backward_prefetch, min_bytes)`` makes a stage's
            offloader (default :class:`Offloader`; ``DistributedPipe`` gives
            one that prefetches from its schedule).
    """
    make = offloader if offloader is not None else _offloader
    n = len(strategy.stages)
    strategy.offloaders = [None] * n
    strategy.checkpoint_offloaders = [None] * n
    mine = [strategy.layers[i] for i in sorted(layers)]
    usage = Usage({p: sum(p in l.select for l in mine) for l in mine for p in l.select})
    for layer_strategy in mine:
        layer = layers[layer_strategy.index]
        s = layer_strategy.stage
        label = f"layer {layer_strategy.index} ({layer_strategy.name})"
        if layer_strategy.recompute:
            mark(layer, FullRecompute())
        elif layer_strategy.select:
            mark(layer, SelectiveRecompute(layer, names=layer_strategy.select, label=label, usage=usage))
        elif layer_strategy.swap is not None or layer_strategy.op_swap:
            stage_offloader = strategy.offloaders[s]
            if stage_offloader is None:
                stage_offloader = strategy.offloaders[s] = make(strategy.default_prefetch, strategy.min_bytes)
            prefetch = layer_strategy.swap if layer_strategy.swap is not None else layer_strategy.op_swap_prefetch
            mark(layer, OffloadLayer(layer, stage_offloader, prefetch, layer_strategy.op_swap, label))
        else:
            mark(layer, None)
    if strategy.checkpoint_swap is not None:
        # Stage 0's checkpoints are slices of the caller's input: offloading them frees nothing.
        for s in sorted({l.stage for l in mine} - {0}):
            strategy.checkpoint_offloaders[s] = make(strategy.checkpoint_swap, strategy.min_bytes)


def _offloader(backward_prefetch: int, min_bytes: int) -> Offloader:
    return Offloader(backward_prefetch, min_bytes=min_bytes)


def attach_to_pipeline(partitions: Sequence[nn.Sequential], config: ConfigSource, checkpoint: str,
                       pipeline: Any) -> RecomputeStrategy:
    """Applies a config to ``Pipe``'s partitions (stage = partition) and wires boundary offload.

    Used by ``Pipe(..., recompute=config)``; ``pipeline`` gets one offload
    hook factory per partition in ``checkpoint_offload``.
    """
    strategy = apply_recompute_config(list(partitions), config)
    warn_checkpoint_interplay(strategy, checkpoint, "Pipe", stacklevel=4)
    pipeline.checkpoint_offload = [strategy.checkpoint_offload(j) for j in range(len(partitions))]
    return strategy


def warn_checkpoint_interplay(strategy: RecomputeStrategy, checkpoint: str, front: str, stacklevel: int = 3
                              ) -> None:
    """What a front end's checkpoint mode leaves of a per-layer config: a warning or an INFO line."""
    has_layer_policy = any(l.recompute or l.select or l.swap is not None or l.op_swap for l in strategy.layers)
    if has_layer_policy and checkpoint == "always":
        warnings.warn(f"{front}(checkpoint='always') recomputes every partition in backward, so the per-layer "
                      "recompute/swap config has no effect; use checkpoint='never' with a per-layer config",
                      stacklevel=stacklevel)
    elif has_layer_policy and checkpoint == "except_last":
        logger.info("%s(checkpoint='except_last'): the per-layer config applies to the last micro-batch "
                    "only (the others recompute whole partitions); checkpoint='never' applies it to all", front)
    if strategy.checkpoint_swap is not None and checkpoint == "never":
        warnings.warn(f"swap_config.checkpoint_swap offloads the inputs {front} keeps for checkpointed "
                      "micro-batches, and checkpoint='never' keeps none; use checkpoint='except_last' or "
                      "'always'", stacklevel=stacklevel)
