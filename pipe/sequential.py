"""Deprecated: the calling convention moved to :mod:`pipe.core.sequential` (``pipe.PipeSequential`` is unchanged)."""
from pipe.core.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(__name__, "pipe.core.sequential", ["PipeSequential", "call_layer", "sequential_like"])
