"""Recompute policies from MindSpore, MindFormers and Paddle, for PyTorch layers inside and outside ``Pipe``.

- :func:`recompute` marks a layer for full recompute (``Cell.recompute()``);
- :func:`select_recompute` recomputes chosen operations of a layer
  (``Primitive.recompute()``, ``select_recompute``), on PyTorch's selective
  activation checkpointing;
- :func:`apply_recompute_config` reads a MindFormers-style
  ``recompute_config``/``swap_config`` (dict or YAML) and marks the layers;
  ``Pipe(..., recompute=config)`` does the same per partition;
- :class:`Offloader` / :func:`offload` move saved activations to host memory
  and prefetch them before backward (recompute-offload, activation SWAP);
- :class:`ActivationMemory` counts the activation bytes a forward keeps.

Guide: docs/recompute.md.
"""
from pipe.recompute.attach import apply_recompute_config
from pipe.recompute.config import load_config, parse_config
from pipe.recompute.memory import ActivationMemory
from pipe.recompute.module import FullRecompute, Policy, policy_of, recompute, unmark
from pipe.recompute.offload import OffloadLayer, Offloader, offload
from pipe.recompute.defaults import DEFAULT_SELECT
from pipe.recompute.selective import SelectiveRecompute, select_recompute
from pipe.recompute.strategy import LayerStrategy, RecomputeStrategy

__all__ = [
    "recompute", "select_recompute", "offload", "unmark", "policy_of",
    "Policy", "FullRecompute", "SelectiveRecompute", "OffloadLayer", "Offloader",
    "apply_recompute_config", "parse_config", "load_config", "RecomputeStrategy", "LayerStrategy",
    "ActivationMemory", "DEFAULT_SELECT",
]
