"""Activation memory, counted: the bytes a forward leaves alive for backward.

Policies are judged by the memory they save, and on the CPU there is no
allocator counter to read. :class:`ActivationMemory` is a dispatch mode that
adds the bytes of every storage an op creates and subtracts them when the
storage is freed (a weak-reference finaliser), so ``live_bytes`` after a
forward is exactly the activation memory kept for backward, and
``peak_bytes`` the high-water mark, independent of timing and of the
allocator. It counts the ops of the thread that entered it, so measure a
model outside ``Pipe`` (whose partitions run on worker threads). Storages
made inside :func:`uncounted` are not counted: host memory that stands in for
the device's, as the offloader's host copies do on the CPU.

Usage::

    with ActivationMemory() as memory:
        loss = model(x).sum()
        kept = memory.live_bytes     # activations held for backward
        loss.backward()
    memory.peak_bytes
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipe.core.inplace import plain_tensors

__all__: list[str] = []

_host = threading.local()


@contextmanager
def uncounted() -> Iterator[None]:
    """Storages this thread makes in the body are not counted by :class:`ActivationMemory`: they stand for
    host memory, not the device's (the offloader's host copies, where the CPU plays the device)."""
    depth = getattr(_host, "depth", 0)
    _host.depth = depth + 1
    try:
        yield
    finally:
        _host.depth = depth


class ActivationMemory(TorchDispatchMode):
    """Counts the bytes of the storages created while it is active, live and peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        """Starts a new high-water mark from the current live bytes."""
        self.peak_bytes = self.live_bytes

    def adjust(self, nbytes: int) -> None:
        """Adds ``nbytes`` (negative: frees them) that changed outside dispatch, e.g. a storage resized in place."""
        with self._lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(_host, "depth", 0):
            return out  # host memory (uncounted)
        inputs = {leaf.untyped_storage().data_ptr() for leaf in plain_tensors(tree_flatten((args, kwargs))[0])}
        for leaf in plain_tensors(tree_flatten(out)[0]):
            if leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or address in inputs:
                continue  # a view or an in-place result: no new memory
            with self._lock:
                if address in self._live:
                    continue
                self._live[address] = size
                self.live_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._free, address)
        return out

    def _free(self, address: int) -> None:
        with self._lock:
            size = self._live.pop(address, 0)
            self.live_bytes -= size
