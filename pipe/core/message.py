"""The size of a message's fixed header between stages, shared by the transport and the planner.

The process runner's transport (:mod:`pipe.distributed.transport`) starts
every message with a header of ``HEADER_BYTES`` bytes that says what follows;
the planner (:mod:`pipe.plan.predict`) counts it in each transfer. A constant
that two layers share lives in the lower one.
"""
from __future__ import annotations

__all__: list[str] = []

HEADER_BYTES = 1024
"""Size of the fixed header message; headers longer than this send the rest in a second message."""
