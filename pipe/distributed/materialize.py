"""A rank's layers built on ``meta``: allocated on its device and initialised by the model's own code, or refused.

``DistributedPipe`` takes a model built under ``torch.device("meta")`` (no
memory) and allocates only the layers of its rank's stages. Allocation gives
uninitialised memory, so every allocated tensor must then be set by code that
knows its value:

* the ``reset_parameters()`` of the module that holds it (``nn.Linear``,
  ``nn.Embedding``, norms, BatchNorm's statistics), as the module's
  constructor does;
* for a stage of :func:`pipe.split`, also the split model's own initialiser,
  as its constructor ends by doing: HuggingFace's ``_init_weights(module)``
  (normal weights, ones for RMSNorm, the rotary ``inv_freq`` recomputed from
  the config). The stage's tensors are put in the original model's modules for
  the call, so the model's code runs unchanged on this rank's share only (the
  other ranks' tensors stay on ``meta``, where any write costs nothing);
* a tensor that an initialiser replaces rather than writes
  (``self.inv_freq = compute()``) is read back from the module.

Which tensors were set is not guessed: each allocated tensor is first filled
with NaN (a sentinel for integers), and one still holding it after the
initialisers is uninitialised. Construction then refuses, on every rank,
naming those tensors by the plain model's names and the fixes.

Tensors a rank's layers share (a weight tied across layers, in one stage or in
two of the rank's stages) stay one tensor; a layer of another rank that shares
one of them points at this rank's copy, so that ties are still found by
identity (:mod:`pipe.distributed.tied_replicas` then makes the replicas of
different ranks equal).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from pipe.core.original_names import plain_name, source_model

__all__: list[str] = []

logger = logging.getLogger(__name__)

DOCS = "docs/distributed.md#not-materialising-other-ranks-layers"

Slot = tuple[int, nn.Module, str, str, str]
"""``(layer index, module, "_parameters" or "_buffers", attribute, name in the layer)``."""


def _slots(layers: Sequence[tuple[str, nn.Module]]) -> Iterator[tuple[Slot, Tensor]]:
    for index, (_, layer) in enumerate(layers):
        for module_name, module in layer.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                for attr, tensor in getattr(module, kind).items():
                    if tensor is not None:
                        yield (index, module, kind, attr, f"{module_name}.{attr}" if module_name else attr), tensor


def _allocate(tensor: Tensor, device: torch.device) -> Tensor:
    data = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def _sentinel(tensor: Tensor) -> Any:
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if tensor.dtype == torch.bool:
        return True
    return torch.iinfo(tensor.dtype).max


def _unset(tensor: Tensor, version: int) -> bool:
    """Whether ``tensor`` still holds the sentinel anywhere (all of it, for integers never written)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return tensor._version == version and bool((tensor == _sentinel(tensor)).all())


class _Fresh:
    """A tensor allocated here: where it is registered and its plain-model names."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.slots: list[Slot] = []
        self.names: list[str] = []
        self.version = 0


def materialize(layers: Sequence[tuple[str, nn.Module]], owned: Sequence[int], device: torch.device,
                initialise: bool = True) -> list[str]:
    """Puts the ``owned`` layers on ``device``; their ``meta`` tensors are allocated there and initialised.

    Args:
        layers: every layer of the model, ``(name in the model, layer)``, in order.
        owned: the indices of this rank's layers.
        device: where they go.
        initialise: False: only the non-persistent buffers (a rotary ``inv_freq``,
            which no checkpoint holds) are allocated and initialised; the
            parameters and persistent buffers stay on ``meta`` for tensor
            parallelism and FSDP to shard first, then :func:`allocate_for_load`
            allocates this rank's shards of them, for a load to fill.

    Returns:
        The plain-model names of the allocated tensors that nothing
        initialised (empty when all were), in the model's order.
    """
    mine = set(owned)
    slots = list(_slots(layers))
    fresh: dict[int, _Fresh] = {}  # id of the meta tensor -> what replaces it
    for slot, tensor in slots:
        index, module, kind, attr, local = slot
        if index not in mine or not tensor.is_meta:
            continue
        if not initialise and (kind == "_parameters" or attr not in module._non_persistent_buffers_set):
            continue
        entry = fresh.get(id(tensor))
        if entry is None:
            entry = fresh[id(tensor)] = _Fresh(_allocate(tensor, device))
        entry.slots.append(slot)
        name = plain_name(layers[index][0], layers[index][1], local)
        if name not in entry.names:
            entry.names.append(name)
    if fresh:
        # Every place that holds a replaced tensor, in this rank's layers and the others', holds the new one:
        # one tensor where the model had one (ties stay ties, also for the skeleton that finds them).
        for (_, module, kind, attr, _), tensor in slots:
            entry = fresh.get(id(tensor))
            if entry is not None:
                getattr(module, kind)[attr] = entry.tensor
    if initialise:  # (else allocate_for_load moves the rest, once the meta tensors are sharded)
        for index in sorted(mine):
            layers[index][1].to(device)  # the rest (a split stage also points its graph's device arguments here)
    if not fresh:
        return []
    entries = list(fresh.values())
    with torch.no_grad():
        for entry in entries:
            entry.tensor.fill_(_sentinel(entry.tensor))
            entry.version = entry.tensor._version
        fresh_ids = {id(entry.tensor) for entry in entries}
        _initialise(layers, mine, entries, fresh_ids)
    unset = [entry.names[0] for entry in entries if _unset(entry.tensor, entry.version)]
    logger.info("allocated %d tensors of layers %s on %s%s", len(entries), sorted(mine), device,
                f"; not initialised: {unset}" if unset else "")
    return unset


def refuse_not_on_meta(model: Any) -> None:
    """Refuses ``init_weights=False`` for a model with no tensor on ``meta`` (it has nothing to leave unset)."""
    if not isinstance(model, nn.Module):
        raise TypeError("init_weights=False needs the model itself (built under torch.device('meta')), not a layer "
                        "factory; a factory's layers are built and initialised by the factory")
    held = next((t for t in list(model.parameters()) + list(model.buffers())), None)
    if held is not None and not held.is_meta:
        raise ValueError(f"init_weights=False leaves a model built on meta unset for a load to fill, but this "
                         f"model's tensors are on {held.device}: build it under torch.device('meta'), or drop "
                         f"init_weights=False")


def mark_loaded(model: nn.Module) -> None:
    """Records that a load set every tensor ``init_weights=False`` left unset (the steps refused before)."""
    if getattr(model, "awaiting_load", False):
        setattr(model, "awaiting_load", False)  # a DistributedPipe's flag (nn.Module types attributes as tensors)


def allocate_for_load(stages: Sequence[nn.Module], device: torch.device) -> list[str]:
    """Allocates on ``device`` the tensors of ``stages`` still on ``meta`` (left so by
    ``materialize(initialise=False)``, then sharded by tensor parallelism and FSDP on ``meta``): this rank's
    local shards only, so that no rank ever holds more than its share. Each is filled with the sentinel
    (NaN; the largest value for integers), for a load to overwrite; the rest of the stages moves to
    ``device``. A tensor held in several places (a tie) is one allocation in all of them; FSDP re-points its
    shards at the new tensors (its ``_apply``), and the caller refreshes the tied-weight replicas. Returns the
    names (in the stages) of the tensors allocated."""
    from torch.distributed.tensor import DTensor

    allocated: list[str] = []
    with torch.no_grad():
        for stage in stages:
            fresh: dict[int, Tensor] = {}  # id of the meta tensor -> its allocation, put in every slot holding it
            for module_name, module in stage.named_modules(remove_duplicate=False):
                for kind in ("_parameters", "_buffers"):
                    slots = getattr(module, kind)
                    for attr, tensor in list(slots.items()):
                        if tensor is None or not tensor.is_meta:
                            continue
                        if id(tensor) not in fresh:
                            new = _allocate(tensor, device)  # a DTensor's local shard only
                            local = new.to_local() if isinstance(new, DTensor) else new
                            local.detach().fill_(_sentinel(local))
                            fresh[id(tensor)] = new
                            allocated.append(f"{module_name}.{attr}" if module_name else attr)
                        slots[attr] = fresh[id(tensor)]
            # The rest to the device; FSDP re-points its shards at the new tensors, a split stage its graph's
            # device arguments at the device.
            stage._apply(lambda t: t.to(device))
    logger.info("allocated %d tensors on %s for a load to fill (this rank's shards only)", len(allocated), device)
    return allocated


def _initialise(layers: Sequence[tuple[str, nn.Module]], mine: set[int], entries: list[_Fresh],
                fresh_ids: set[int]) -> None:
    """Runs the initialisers over the allocated tensors (under ``no_grad``), keeping every other tensor's value."""
    by_layer: dict[int, list[_Fresh]] = {}
    for entry in entries:
        by_layer.setdefault(entry.slots[0][0], []).append(entry)
    sources: dict[int, tuple[nn.Module, list[_Fresh]]] = {}
    for index in sorted(by_layer):
        layer = layers[index][1]
        source = source_model(layer)
        if source is not None:
            sources.setdefault(id(source), (source, []))[1].extend(by_layer[index])
            continue
        # A layer of the nn.Sequential: its modules' own reset_parameters(), as their constructors call it.
        with _kept([t for t in _tensors(layer) if id(t) not in fresh_ids]):
            for module in layer.modules():
                _reset(module)
    for source, split_entries in sources.values():
        _initialise_from_source(source, split_entries, fresh_ids)


def _tensors(module: nn.Module) -> list[Tensor]:
    return list(module.parameters()) + list(module.buffers())


class _kept:
    """Restores the values of ``tensors`` (real ones: an initialiser must only set what was allocated)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.saved = [(t, t.detach().clone()) for t in tensors if not t.is_meta]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        for tensor, value in self.saved:
            tensor.detach().copy_(value)


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _initialise_from_source(source: nn.Module, entries: list[_Fresh], fresh_ids: set[int]) -> None:
    """Initialises split stages' tensors with ``source``'s code: each is put where ``source`` has it, then
    ``reset_parameters()`` and, in a HuggingFace model, ``_init_weights(module)`` run on the modules that
    hold one and on their ancestors, children first."""
    modules = dict(source.named_modules(remove_duplicate=False))
    swapped: list[tuple[nn.Module, str, str, Any, _Fresh]] = []
    followers: list[tuple[_Fresh, _Fresh]] = []  # (copy, leader): a later stage's copy of a buffer
    placed: dict[str, _Fresh] = {}
    owners: set[str] = set()
    for entry in entries:
        for name in entry.names:
            path, _, attr = name.rpartition(".")
            owner = modules.get(path)
            if owner is None:
                continue
            kind = "_parameters" if attr in owner._parameters else "_buffers" if attr in owner._buffers else None
            if kind is None:
                continue
            leader = placed.get(name)
            if leader is not None:
                if leader is not entry and (entry, leader) not in followers:
                    followers.append((entry, leader))
                continue
            placed[name] = entry
            swapped.append((owner, kind, attr, getattr(owner, kind)[attr], entry))
            owners.add(path)
    affected = {""}  # the modules holding one, and their ancestors (GPT-2 initialises c_proj from its block)
    for path in owners:
        atoms = path.split(".") if path else []
        affected.update(".".join(atoms[:k]) for k in range(1, len(atoms) + 1))
    for owner, kind, attr, _, entry in swapped:
        getattr(owner, kind)[attr] = entry.tensor
    order = _post_order(source, affected)
    others = [t for _, module, _ in order for t in _tensors(module) if id(t) not in fresh_ids]
    try:
        with _kept(others):  # a source built partly on a device: only this rank's allocated tensors change
            for _, module, _ in order:
                _reset(module)  # as the modules' constructors do, children first
            for _, module, init_weights in order:
                if init_weights is not None:
                    init_weights(module)  # as HuggingFace's post_init does, children first
        for owner, kind, attr, _, entry in swapped:
            current = getattr(owner, kind).get(attr)
            if current is not None and current is not entry.tensor and not current.is_meta \
                    and current.shape == entry.tensor.shape:
                entry.tensor.copy_(current)  # an initialiser that assigns a new tensor (self.inv_freq = ...)
    finally:
        for owner, kind, attr, original, _ in swapped:
            getattr(owner, kind)[attr] = original
    for entry, leader in followers:
        entry.tensor.copy_(leader.tensor)


def _hf_model_class() -> Optional[type]:
    transformers = sys.modules.get("transformers")  # a model of it exists only if it was imported
    return getattr(transformers, "PreTrainedModel", None) if transformers is not None else None


def _post_order(source: nn.Module, affected: set[str]) -> list[tuple[str, nn.Module, Optional[Callable[..., Any]]]]:
    """The ``affected`` modules of ``source``, children before their parent (as ``nn.Module.apply`` and
    HuggingFace's ``smart_apply`` visit them), each with the ``_init_weights`` that applies to it: that of
    the nearest HuggingFace ``PreTrainedModel`` containing it, as ``smart_apply`` picks it."""
    hf_model = _hf_model_class()
    found: list[tuple[str, nn.Module, Optional[Callable[..., Any]]]] = []
    seen: set[int] = set()

    def visit(path: str, module: nn.Module, init_weights: Optional[Callable[..., Any]]) -> None:
        if id(module) in seen or path not in affected:
            return
        seen.add(id(module))
        if hf_model is not None and isinstance(module, hf_model):
            init_weights = getattr(module, "_init_weights")
        for name, child in module._modules.items():
            if child is not None:
                visit(f"{path}.{name}" if path else name, child, init_weights)
        found.append((path, module, init_weights))

    visit("", source, None)
    return found


def refusal(names: Sequence[str]) -> Optional[str]:
    """The message refusing a model whose allocated tensors ``names`` nothing initialised (None if none)."""
    if not names:
        return None
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"the model was built on meta and nothing initialises {shown} once a rank allocates them: neither "
        f"their modules' reset_parameters() nor the model's own initialiser (HuggingFace's _init_weights, for "
        f"a model cut by pipe.split) sets them, so they would train from uninitialised memory; give those "
        f"modules a reset_parameters() that sets every parameter and buffer they hold, or build the model on "
        f"the CPU (not under torch.device('meta')); see {DOCS}"
    )
