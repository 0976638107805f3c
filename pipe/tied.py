"""Deprecated: tying parameters across partitions moved to :mod:`pipe.core.tying`."""
from pipe.core.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(__name__, "pipe.core.tying", ["Tie", "find_ties", "tie_partitions"])
