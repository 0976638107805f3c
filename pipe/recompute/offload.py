"""Offload: tensors kept for backward go to host memory in forward and come back before backward.

Paddle's recompute-offload moves the checkpoints to host memory; MindFormers'
activation SWAP does so for chosen layers and ops and prefetches them
``backward_prefetch`` steps before backward needs them. :class:`Offloader`
does both with :func:`torch.autograd.graph.saved_tensors_hooks`:

- forward: every tensor saved for backward inside :meth:`Offloader.unit` is
  copied to host memory (pinned, on a side stream, on CUDA) and the device
  copy is released once the copy is done. Parameters (and their views) and
  tiny tensors stay where they are.
- backward: the first time a unit's tensors are needed, the units registered
  up to ``backward_prefetch`` places before it are copied back on the side
  stream, so that their transfer overlaps with this unit's backward; a unit
  that was not prefetched in time is fetched on the spot.

Units are counted per offloader in forward order: one per offloaded layer
call, or per checkpointed micro-batch for the inputs ``Pipe`` keeps at a
partition boundary (:class:`pipe.core.checkpoint.Checkpointing`). On the CPU the
CPU plays the device: the "host copy" is a second CPU tensor, made inside
:func:`pipe.recompute.memory.uncounted` (so :class:`ActivationMemory` counts the
bytes a device would hold, as :mod:`pipe.plan` counts an offloading stage), and
a copy back is a new tensor, as a device's would be. Nothing is saved, but the
mechanism, its ordering, its gradients and the counted device bytes are those
of a GPU, and are what the tests check.
:attr:`Offloader.events` records ``("offload"|"prefetch"|"fetch"|"use", unit)``.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from pipe.recompute.memory import uncounted
from pipe.recompute.module import Policy, mark
from pipe.recompute.scope import Scope, compile_pattern

__all__: list[str] = []

logger = logging.getLogger(__name__)


class _Stored:
    """One device storage copied to host memory; every tensor saved from it is a view of it."""

    __slots__ = ("unit", "host", "device", "ready", "event", "__weakref__")

    def __init__(self, unit: "_Unit", host: Tensor, device: torch.device, event: Any) -> None:
        self.unit = unit
        self.host = host                     # 1-D, the whole storage
        self.device = device
        self.ready: Optional[Tensor] = None  # the device copy once fetched
        self.event = event                   # CUDA event of the last copy, None on the CPU


class _Packed:
    """What autograd holds instead of a saved tensor: a view of a stored storage."""

    __slots__ = ("stored", "size", "stride", "offset")

    def __init__(self, stored: _Stored, tensor: Tensor) -> None:
        self.stored = stored
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()

    def __del__(self) -> None:
        self.stored.unit.release()


class _Unit:
    """The tensors one layer call (or one checkpointed micro-batch) saved for backward."""

    def __init__(self, offloader: "Offloader", index: int, name: str, prefetch: int, tag: Any = None) -> None:
        self.offloader = offloader
        self.index = index
        self.name = name
        self.prefetch = prefetch
        self.tag = tag  # what the unit belongs to, for a caller that prefetches by tag (Offloader.tagged)
        # Weak: a stored storage lives as long as the autograd graph holds views of it.
        self.stored: list[weakref.ref[_Stored]] = []
        self.fetched = False
        self.used = False
        self.alive = 0
        # Views of one storage (q, k, v of one qkv; softmax's output saved twice) are copied
        # once. Addresses are reused once a device copy is freed, so an entry holds the
        # storage weakly and counts only while that very storage is alive.
        self.dedup: dict[tuple[Any, ...], tuple[weakref.ref[Any], weakref.ref[_Stored]]] = {}

    def release(self) -> None:
        self.alive -= 1
        if self.alive <= 0:
            self.offloader._drop(self)


class Offloader:
    """Moves saved activations to host memory in forward and prefetches them for backward.

    Usage::

        offloader = Offloader(backward_prefetch=1)
        for layer in layers:
            with offloader.unit(f"layer {i}"):
                x = layer(x)
        x.sum().backward()      # units come back in reverse order, one ahead

    Args:
        backward_prefetch: default number of units ahead of backward that a
            unit is copied back (0: only when needed).
        min_bytes: tensors smaller than this stay on the device.
        record_events: keep :attr:`events` (for tests and measurements).
        prefetch_on_use: when a unit is first used, prefetch the units
            registered up to their ``backward_prefetch`` places before it (the
            default, for a backward that visits units in reverse forward
            order). ``False`` for a caller that knows the backward order and
            calls :meth:`prefetch` itself (``DistributedPipe``, from its schedule).
    """

    def __init__(self, backward_prefetch: int = 1, *, min_bytes: int = 1024, record_events: bool = False,
                 prefetch_on_use: bool = True) -> None:
        if not isinstance(backward_prefetch, int) or isinstance(backward_prefetch, bool) or backward_prefetch < 0:
            raise ValueError(f"backward_prefetch must be an int >= 0, got {backward_prefetch!r}")
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self.backward_prefetch = backward_prefetch
        self.min_bytes = min_bytes
        self.record_events = record_events
        self.prefetch_on_use = prefetch_on_use
        self.events: list[tuple[str, int]] = []
        # Called with (kind, unit name, unit tag) for every event, if set.
        self.observer: Optional[Callable[[str, str, Any], None]] = None
        self.current_tag: Any = None  # what units registered now belong to (see tagged)
        self.offloaded_bytes = 0
        self.offloaded_copies = 0  # storages copied to host memory (one copy each)
        self._units: OrderedDict[int, _Unit] = OrderedDict()
        self._counter = itertools.count()
        self._lock = threading.RLock()
        self._streams: dict[torch.device, Any] = {}

    # -- forward --------------------------------------------------------------------------

    @contextmanager
    def unit(self, name: str = "", backward_prefetch: Optional[int] = None,
             select: Optional[Callable[[], bool]] = None) -> Iterator[None]:
        """Offloads the tensors saved for backward in the body, as one unit.

        Args:
            name: how logs name the unit.
            backward_prefetch: this unit's prefetch distance (default: the offloader's).
            select: if given, a tensor is offloaded only when ``select()`` is true
                at the moment it is saved.
        """
        prefetch = self.backward_prefetch if backward_prefetch is None else backward_prefetch
        with self._lock:
            unit = _Unit(self, next(self._counter), name, prefetch, self.current_tag)
            self._units[unit.index] = unit

        def pack(tensor: Tensor) -> Any:
            if select is not None and not select():
                return tensor
            return self._pack(unit, tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            with self._lock:
                if unit.alive == 0:
                    self._units.pop(unit.index, None)  # nothing offloaded: nothing to track

    @contextmanager
    def tagged(self, tag: Any) -> Iterator[None]:
        """Units registered in the body carry ``tag`` (e.g. the pipeline cell whose forward made them)."""
        orig, self.current_tag = self.current_tag, tag
        try:
            yield
        finally:
            self.current_tag = orig

    def prefetch(self, tag: Any, distance: int) -> None:
        """Copies back the units tagged ``tag`` whose ``backward_prefetch`` is at least ``distance``.

        The caller knows its backward order: it calls this ``distance``
        steps before the backward that uses the units tagged ``tag``.
        """
        with self._lock:
            for unit in list(self._units.values()):
                if unit.tag == tag and not unit.fetched and unit.prefetch >= distance:
                    self._fetch(unit, "prefetch")

    def discard(self) -> None:
        """Forgets the units not used in backward yet: a forward that will not be backpropagated (a warm-up)
        leaves nothing for later units to prefetch, and its host copies go with its graph."""
        with self._lock:
            for unit in list(self._units.values()):
                if not unit.used:
                    self._units.pop(unit.index, None)

    def hooks(self, name: str = "", backward_prefetch: Optional[int] = None) -> Callable[[], Any]:
        """A factory of :meth:`unit` contexts (what ``Checkpointing(offload=...)`` takes)."""
        return lambda: self.unit(name, backward_prefetch)

    def _keep_in_place(self, tensor: Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True  # a parameter (or a view of one): it stays on the device anyway
        return tensor.numel() * tensor.element_size() < self.min_bytes or tensor.device.type == "meta"

    def _pack(self, unit: _Unit, tensor: Tensor) -> Any:
        if self._keep_in_place(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.dtype)
        with self._lock:
            entry = unit.dedup.get(key)
            stored = entry[1]() if entry is not None and entry[0]() is storage else None
            if stored is not None:
                unit.alive += 1
                return _Packed(stored, tensor)
        # The whole storage as one flat tensor: views of it are rebuilt in backward.
        flat = tensor.detach().as_strided((storage.nbytes() // tensor.element_size(),), (1,), 0)
        device = tensor.device
        if device.type == "cuda":
            stream = self._stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), uncounted():  # host memory, not the device's
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            flat.record_stream(stream)  # the device memory is reused only after the copy
        else:
            with uncounted():  # host memory, not the device's
                host, event = flat.clone(), None
        stored = _Stored(unit, host, device, event)
        with self._lock:
            unit.stored.append(weakref.ref(stored))
            unit.dedup[key] = (weakref.ref(storage), weakref.ref(stored))
            unit.alive += 1
            self.offloaded_bytes += host.numel() * host.element_size()
            self.offloaded_copies += 1
            if len(unit.stored) == 1:
                self._event("offload", unit)
        return _Packed(stored, tensor)

    # -- backward -------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        stored: _Stored = packed.stored
        unit = stored.unit
        with self._lock:
            if not unit.used:
                unit.used = True
                unit.dedup.clear()  # forward is over for this unit
                if not unit.fetched:
                    self._fetch(unit, "fetch")
                self._event("use", unit)
                for other in reversed(list(self._units.values())) if self.prefetch_on_use else ():  # nearest first
                    if other.index < unit.index and not other.fetched and other.index + other.prefetch >= unit.index:
                        self._fetch(other, "prefetch")
            base = stored.ready
            if base is None:  # stored after its unit was fetched
                base = stored.ready = self._copy_back(stored)
        if base.device.type == "cuda":
            current = torch.cuda.current_stream(base.device)
            if stored.event is not None:
                current.wait_event(stored.event)
            base.record_stream(current)
        return base.as_strided(packed.size, packed.stride, packed.offset)

    def _fetch(self, unit: _Unit, kind: str) -> None:
        unit.fetched = True
        for ref in unit.stored:
            stored = ref()
            if stored is not None and stored.ready is None:
                stored.ready = self._copy_back(stored)
        self._event(kind, unit)

    def _copy_back(self, stored: _Stored) -> Tensor:
        if stored.device.type != "cuda":
            return stored.host.clone()  # a new "device" tensor, counted, as a GPU's copy back would be
        stream = self._stream(stored.device)
        with torch.cuda.stream(stream):
            tensor = stored.host.to(stored.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        stored.event = event
        return tensor

    # -- bookkeeping ----------------------------------------------------------------------

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _event(self, kind: str, unit: _Unit) -> None:
        if self.record_events:
            self.events.append((kind, unit.index))
        if self.observer is not None:
            self.observer(kind, unit.name, unit.tag)
        logger.debug("offload: %s unit %d (%s)", kind, unit.index, unit.name)

    def _drop(self, unit: _Unit) -> None:
        with self._lock:
            self._units.pop(unit.index, None)

    def pending_units(self) -> int:
        """Units whose tensors are still held (0 once every graph is freed)."""
        with self._lock:
            return len(self._units)

    def __getstate__(self) -> dict[str, Any]:
        return {"backward_prefetch": self.backward_prefetch, "min_bytes": self.min_bytes,
                "record_events": self.record_events, "prefetch_on_use": self.prefetch_on_use}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["backward_prefetch"], min_bytes=state["min_bytes"],  # type: ignore[misc]
                      record_events=state["record_events"], prefetch_on_use=state.get("prefetch_on_use", True))


class OffloadLayer(Policy):
    """Offloads what a layer (or the submodules matching ``names``) saves for backward.

    Args:
        layer: the layer.
        offloader: shared by the layers of one stage, so prefetch counts across them.
        backward_prefetch: this layer's prefetch distance (default: the offloader's).
        names: if given, only tensors saved inside submodules whose qualified
            name fully matches one of these regexes are offloaded (op swap).
        label: how logs name the layer.
    """

    def __init__(self, layer: nn.Module, offloader: Offloader, backward_prefetch: Optional[int] = None,
                 names: tuple[str, ...] = (), label: str = "") -> None:
        self.offloader = offloader
        self.backward_prefetch = backward_prefetch
        self.names = tuple(names)
        self._patterns = [compile_pattern(n, "op_swap op_name") for n in self.names]
        self.scope = Scope.of(layer) if self.names else None
        self.label = label or type(layer).__name__

    def describe(self) -> str:
        what = f"op_swap {list(self.names)}" if self.names else "swap"
        prefetch = self.offloader.backward_prefetch if self.backward_prefetch is None else self.backward_prefetch
        return f"{what} backward_prefetch={prefetch}"

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        if not self.names:
            with self.offloader.unit(self.label, self.backward_prefetch):
                return self.regioned(forward)(*args, **kwargs)
        scope, patterns = self.scope, self._patterns
        assert scope is not None  # set with names

        def chosen() -> bool:
            # Only tensors saved inside the chosen submodules leave the device.
            return any(p.fullmatch(path) for p in patterns for path in scope.enclosing())

        with self.offloader.unit(self.label, self.backward_prefetch, select=chosen):
            return self.regioned(forward)(*args, **kwargs)


def offload(layer: nn.Module, offloader: Offloader, backward_prefetch: Optional[int] = None,
            names: tuple[str, ...] = ()) -> nn.Module:
    """Marks ``layer`` to offload its saved activations through ``offloader``; returns it.

    Usage::

        offloader = Offloader(backward_prefetch=1)
        for block in model.blocks:
            offload(block, offloader)

    Raises:
        ValueError: a regex in ``names`` does not compile.
    """
    return mark(layer, OffloadLayer(layer, offloader, backward_prefetch, tuple(names)))
