"""pipe: pipeline-parallel training for PyTorch.

``Pipe(model, chunks=8, checkpoint="except_last")`` runs an ``nn.Sequential``
as a GPipe pipeline over devices, with recomputation of activations.

The package, by layer from the bottom (``docs/design.md`` draws it, and
``tests/test_layers.py`` checks that no module imports from a layer above):

* ``pipe.trace``: the recorder every layer may call.
* ``pipe.core``: what both runners share: schedules as data, micro-batches,
  the checkpointed cell, random-number replay, partitioning, the calling
  convention (``PipeSequential``), parameters tied across partitions, streams
  and copies, and the argument checks of the front ends (``pipe.core.options``).
* observation: ``pipe.viz`` (timelines of plans and recordings, and where idle
  time went).
* features: ``pipe.skip``, ``pipe.recompute``, ``pipe.balance``,
  ``pipe.batchnorm``, ``pipe.plan``.
* runners: ``pipe.threads`` (one worker thread per partition, behind
  :class:`Pipe`) and ``pipe.distributed`` (one stage per rank under torchrun,
  behind ``DistributedPipe``).
* front ends: :class:`Pipe`, ``DistributedPipe``, :func:`split`, ``pipe-viz``,
  ``pipe-plan``.

Names are loaded on first use, so ``import pipe.core.schedule`` (which needs
no torch) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type checkers see the names; the interpreter loads them on first use
    from pipe import balance, skip
    from pipe.core.checkpoint import is_checkpointing, is_recomputing
    from pipe.core.microbatch import NoChunk
    from pipe.pipe import Pipe
    from pipe.core.sequential import PipeSequential
    from pipe.graph_split import SplitError, split
    from pipe.threads.call import PipeClosedError
    from pipe.compile import CompileError
    from pipe.core.cost_order import schedule_from_costs
    from pipe.core.stage_costs import StageCosts

__all__ = ["Pipe", "PipeSequential", "NoChunk", "split", "is_checkpointing", "is_recomputing", "balance", "skip",
           "PipeClosedError", "SplitError", "CompileError", "schedule_from_costs", "StageCosts"]
__version__ = "0.1.0"

_NAMES = {
    "Pipe": ("pipe.pipe", "Pipe"),
    "PipeSequential": ("pipe.core.sequential", "PipeSequential"),
    "NoChunk": ("pipe.core.microbatch", "NoChunk"),
    "split": ("pipe.graph_split", "split"),
    "is_checkpointing": ("pipe.core.checkpoint", "is_checkpointing"),
    "is_recomputing": ("pipe.core.checkpoint", "is_recomputing"),
    "PipeClosedError": ("pipe.threads.call", "PipeClosedError"),
    "SplitError": ("pipe.graph_split", "SplitError"),
    "CompileError": ("pipe.compile", "CompileError"),
    "schedule_from_costs": ("pipe.core.cost_order", "schedule_from_costs"),
    "StageCosts": ("pipe.core.stage_costs", "StageCosts"),
}
_SUBMODULES = {"balance", "skip", "recompute", "distributed", "trace", "viz", "batchnorm", "core", "threads",
               "plan"}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        module, attr = _NAMES[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pipe.{name}")
    else:
        raise AttributeError(f"module 'pipe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES) | _SUBMODULES)
