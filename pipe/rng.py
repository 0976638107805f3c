"""Random number state: capture it for recomputation and keep partitions' draws apart.

Recomputation must draw the same random numbers as the first forward (the
same dropout mask), so the state of the generators a partition uses is saved
before a checkpointed forward and replayed around its recomputation.

PyTorch has one CPU generator per process and one generator per CUDA device,
shared by every thread. When two partitions on one device run concurrently and
both draw random numbers, their draws interleave, and a replay from the saved
state would not reproduce either of them. :class:`RandomnessGuard` prevents
that without giving up concurrency where it is safe: the first time a partition
runs in a mode (training or not) it runs under the generator's lock and is
watched; partitions that drew random numbers keep taking the lock, those that
did not run freely from then on.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

__all__ = ["RNGState", "save_rng_state", "restore_rng_state", "RandomnessGuard"]

RNGState = tuple[Tensor, Optional[Tensor]]

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _generator_lock(device: torch.device) -> threading.Lock:
    key = str(device) if device.type == "cuda" else "cpu"
    with _locks_guard:
        lock = _locks.get(key)
        if lock is None:
            lock = _locks[key] = threading.Lock()
    return lock


def save_rng_state(device: torch.device) -> RNGState:
    """The CPU generator's state and, for a CUDA device, that device's."""
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, gpu


@contextmanager
def restore_rng_state(device: torch.device, state: RNGState) -> Iterator[None]:
    """Runs the body from ``state`` and puts the generators back afterwards."""
    cpu, gpu = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
        yield


class RandomnessGuard:
    """Serialises a partition's forward with others on its device only if it draws random numbers.

    One guard per partition. Use ``with guard.forward(training):`` around every
    forward of the partition that runs concurrently with other partitions.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = _generator_lock(device)
        # training flag -> whether the partition draws random numbers
        self._draws: dict[bool, bool] = {}

    def draws(self, training: bool) -> Optional[bool]:
        """Whether the partition was seen drawing random numbers (None: not run yet)."""
        return self._draws.get(training)

    @contextmanager
    def forward(self, training: bool) -> Iterator[None]:
        known = self._draws.get(training)
        if known is False:
            yield
            return
        with self._lock:
            if known is None:
                before = save_rng_state(self.device)
                yield
                after = save_rng_state(self.device)
                self._draws[training] = not _same(before, after)
            else:
                yield


def _same(a: RNGState, b: RNGState) -> bool:
    if not torch.equal(a[0], b[0]):
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    return torch.equal(a[1], b[1])
