"""The sizes of a message between stages, shared by the transport and the planner.

The process runner's transport (:mod:`pipe.distributed.transport`) starts
every message with a header of ``HEADER_BYTES`` bytes that says what follows;
the planner (:mod:`pipe.plan.predict`) counts it in each transfer. A constant
that two layers share lives in the lower one.
"""
from __future__ import annotations

__all__: list[str] = []

HEADER_BYTES = 1024
"""Size of the fixed header message; headers longer than this send the rest in a second message."""

INLINE_BYTES = 64 * 1024
"""Values whose tensors hold at most this many bytes travel behind their header, in one message, once their
layout repeats: the sender copies them into the header's buffer, which its pending send holds.

Copying them costs less than a message of their own (a message costs about 50
microseconds on gloo over loopback; a copy of 64 KiB, a few)."""


def sent_copy_bytes(value_bytes: int) -> int:
    """Bytes a pending send holds beyond its header and the value itself: the inline copy of a small value."""
    return value_bytes if value_bytes <= INLINE_BYTES else 0
