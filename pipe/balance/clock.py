"""A clock for work as a stage runs it: the wall clock on the CPU, events on the current stream on CUDA.

Used by :mod:`pipe.balance.timing` to time layers and cells.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from pipe.balance.profile import synchronize

__all__: list[str] = []


class Clock:
    """Times work as a stage runs it: on the CPU by the wall clock; on CUDA by events on the current
    stream, with no synchronisation until the times are read, so that the host's work on one layer
    overlaps the kernels queued before it as it does in a stage (synchronising around each layer
    charged every forward and backward the launch latency and the idle device: on an H100 a plan of 8
    micro-batches was predicted 10% slower than it ran, and one with recompute marks 37%).

    Usage::

        clock = Clock(device)
        with clock.span(("forward", 0)):
            ...
        clock.spans("forward", 1)              # [0.0012]
        clock.stamp("a"); ...; clock.stamp("b")
        clock.between("a", "b")                # seconds from one stamp to the other (0 if either is missing)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stamps: dict[Any, Any] = {}
        self._settled = True
        synchronize(device)

    def stamp(self, key: Any) -> None:
        """Marks this moment as ``key`` (again: the later moment)."""
        if not self.cuda:
            self.stamps[key] = time.perf_counter()
            return
        self._settled = False
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self.stamps[key] = event

    @contextlib.contextmanager
    def span(self, key: Any) -> Iterator[None]:
        """Times the block as ``key`` (only its start is kept if it raises)."""
        self.stamp(("start", key))
        yield
        self.stamp(("end", key))

    def between(self, first: Any, last: Any) -> float:
        if first not in self.stamps or last not in self.stamps:
            return 0.0
        if not self.cuda:
            return float(self.stamps[last] - self.stamps[first])
        if not self._settled:  # the events recorded so far have happened
            synchronize(self.device)
            self._settled = True
        return float(self.stamps[first].elapsed_time(self.stamps[last])) / 1000

    def spans(self, what: str, count: int) -> list[float]:
        """Seconds of the spans ``(what, 0)`` to ``(what, count - 1)`` (0 for one not timed)."""
        return [self.between(("start", (what, k)), ("end", (what, k))) for k in range(count)]
