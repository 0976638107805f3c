"""The recompute configuration: MindFormers' ``recompute_config`` and ``swap_config`` for PyTorch layers.

A dict or a YAML file says, per pipeline stage, how many layers recompute
fully, which operations of which layers recompute selectively, and which
layers (or submodules of layers) offload their saved activations to host
memory. :func:`parse_config` normalises it into one :class:`LayerStrategy` per
layer (with clear errors for bad keys, regexes, counts and list lengths);
:func:`pipe.recompute.attach.apply_recompute_config` puts the matching
policies on the layers, with or without ``Pipe``. The normalised strategy is logged at INFO as a dict that
is itself a valid config, then one line per layer.

Precedence (from the seeds): full recompute wins over selective recompute on
the same layer; recompute (full or selective) wins over offload on the same
layer, which also drops the offload of an op whose consumer is recomputed;
a whole-layer swap covers op swaps on that layer. See docs/recompute.md.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from pipe.core.options import is_int
from pipe.recompute.scope import compile_pattern
from pipe.recompute.defaults import DEFAULT_SELECT
from pipe.recompute.strategy import LayerStrategy, RecomputeStrategy

__all__: list[str] = []

logger = logging.getLogger(__name__)

RECOMPUTE_KEYS = ("recompute", "select_recompute")
# MindFormers keys about communication operators, which a pipe layer does not have.
MINDFORMERS_COMM_KEYS = ("select_comm_recompute", "parallel_optimizer_comm_recompute", "mp_comm_recompute",
                         "recompute_slice_activation")
SWAP_KEYS = ("swap", "default_prefetch", "layer_swap", "op_swap", "checkpoint_swap", "min_bytes")
SECTIONS = ("recompute_config", "swap_config")

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], "RecomputeStrategy"]


# -- reading -------------------------------------------------------------------------------


def load_config(path: Union[str, "os.PathLike[str]"]) -> dict[str, Any]:
    """Reads a YAML file (PyYAML ``safe_load``) holding ``recompute_config`` and/or ``swap_config``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not YAML or does not hold a mapping.
    """
    import yaml  # PyYAML: the format MindFormers' configs are written in

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"recompute config {os.fspath(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recompute config {os.fspath(path)!r} must hold a mapping with recompute_config "
                         f"and/or swap_config, got {type(data).__name__}")
    return data


def _sections(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    if any(key in config for key in SECTIONS):
        ignored = [k for k in config if k not in SECTIONS]
        if ignored:
            logger.debug("recompute config: ignoring top-level keys %s", ignored)
        recompute = config.get("recompute_config") or {}
        swap = config.get("swap_config") or {}
        for name, section in (("recompute_config", recompute), ("swap_config", swap)):
            if not isinstance(section, Mapping):
                raise TypeError(f"{name} must be a mapping, got {section!r}")
        return dict(recompute), dict(swap)
    return dict(config), {}


def _count(count: Any, size: int, where: str, kind: str, limit: str) -> int:
    """A layer count of a config list (``True``: all ``size`` layers, ``False``: none), checked."""
    if count is True:
        return size
    if count is False:
        return 0
    if not is_int(count) or count < 0:
        raise ValueError(f"{where} = {count!r}: a {kind} count must be an int >= 0 or True/False")
    if count > size:
        raise ValueError(f"{where} = {count} but {limit}; use at most {size} (or True for all of them)")
    return int(count)


def _per_rank_counts(value: Sequence[Any], key: str, stages: Sequence[int], ranks: int) -> list[Any]:
    """MindFormers' ``pipeline_stage`` counts with virtual stages: one count per rank, spread over its chunks.

    Stage ``s`` runs on rank ``s % ranks`` (chunk ``s // ranks``). As
    MindFormers' ``LayerSetting`` does with ``pp_interleave_num > 1``, a rank's
    count is dealt round-robin over its chunks (one layer to chunk 0, one to
    chunk 1, ..., skipping full chunks); each chunk then takes its share from
    its first layer.
    """
    chunks = len(stages) // ranks
    counts = [0] * len(stages)
    for r, count in enumerate(value):
        mine = [c * ranks + r for c in range(chunks)]
        size = sum(stages[s] for s in mine)
        count = _count(count, size, f"{key}[{r}]", "per-rank",
                       f"pipeline rank {r} has only {size} layers (stages {mine}, "
                       f"layers per stage {[stages[s] for s in mine]})")
        while count:
            for s in mine:
                if count and counts[s] < stages[s]:
                    counts[s] += 1
                    count -= 1
    return counts


def _layer_mask(value: Any, key: str, stages: Sequence[int], swap: bool, ranks: Optional[int] = None) -> list[bool]:
    """One bool per layer from bool | per-stage counts | 2D counts | (swap on) layer indices.

    With ``ranks`` (a multi-process pipeline of ``len(stages) // ranks``
    virtual stages per rank), a flat list of ``ranks`` counts is per rank
    (:func:`_per_rank_counts`) and a 2D list must be ``[chunk][rank]``.
    """
    total = sum(stages)
    if value is None or value is False:
        return [False] * total
    if value is True:
        return [True] * total
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{key} must be True/False or a list of per-stage counts, got {value!r}")
    if swap:
        # With swap on, MindFormers reads a flat list as layer indices.
        if not all(is_int(i) for i in value):
            raise TypeError(f"{key} = {value!r}: with swap_config.swap on, a list holds layer indices (ints)")
        bad = [i for i in value if not 0 <= i < total]
        if bad:
            raise ValueError(f"{key} = {value!r}: layer indices {bad} out of range; the model has {total} layers "
                             f"(0..{total - 1})")
        return [i in set(value) for i in range(total)]
    nested = bool(value) and all(isinstance(r, (list, tuple)) for r in value)
    flat = [c for row in value for c in row] if nested else list(value)
    virtual = ranks is not None and len(stages) != ranks
    if virtual and nested:
        assert ranks is not None
        shape = [len(row) for row in value]
        if len(value) != len(stages) // ranks or any(n != ranks for n in shape):
            raise ValueError(
                f"{key} = {value!r} has rows of {shape} counts but the pipeline has {len(stages) // ranks} "
                f"virtual stages (chunks) of {ranks} ranks; give one row per chunk with one count per rank "
                f"(MindFormers' [pp_interleave_num][pipeline_stage]), or {ranks} per-rank counts"
            )
    elif virtual and len(flat) == ranks:
        assert ranks is not None
        flat = _per_rank_counts(flat, key, stages, ranks)
    if len(flat) != len(stages):
        raise ValueError(
            f"{key} = {value!r} gives {len(flat)} per-stage counts but there are {len(stages)} stages "
            f"(layers per stage {list(stages)}); give one count per stage (a 2D list is flattened "
            "chunk-major for virtual stages), "
            + (f"one count per pipeline rank ({ranks}), " if virtual else "")
            + "or True/False for every layer"
        )
    mask: list[bool] = []
    for s, (count, size) in enumerate(zip(flat, stages)):
        count = _count(count, size, f"{key}[{s}]", "per-stage", f"stage {s} has only {size} layers")
        mask += [True] * count + [False] * (size - count)
    return mask


def _canonical_mask(mask: list[bool], stages: Sequence[int], swap: bool) -> Any:
    """The shortest form of a mask that reads back the same: bool, counts or indices."""
    if all(mask):
        return True
    if not any(mask):
        return False
    if swap:
        return [i for i, m in enumerate(mask) if m]
    counts, start = [], 0
    for size in stages:
        counts.append(sum(mask[start:start + size]))
        start += size
    return counts


def _select_masks(value: Any, stages: Sequence[int], swap: bool, ranks: Optional[int] = None
                  ) -> dict[str, list[bool]]:
    total = sum(stages)
    if value is None or isinstance(value, bool) or (
            isinstance(value, (list, tuple)) and value and all(not isinstance(v, str) for v in value)):
        mask = _layer_mask(value, "select_recompute", stages, swap, ranks)
        return {pattern: mask for pattern in DEFAULT_SELECT} if any(mask) else {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise TypeError(f"select_recompute = {value!r} mixes regexes and counts; use a dict "
                            "{regex: counts} to give counts per regex")
        value = {v: True for v in value}
    if not isinstance(value, Mapping):
        raise TypeError(f"select_recompute must be a bool, per-stage counts, a list of regexes or a dict "
                        f"{{regex: bool | counts}}, got {value!r}")
    masks = {}
    for pattern, setting in value.items():
        compile_pattern(pattern, "select_recompute")
        mask = _layer_mask(setting, f"select_recompute[{pattern!r}]", stages, swap, ranks)
        if any(mask):
            masks[pattern] = mask
    assert all(len(m) == total for m in masks.values())
    return masks


def _prefetch(value: Any, where: str) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{where} backward_prefetch = {value!r}; it must be an int >= 0 "
                         "(how many units ahead of backward the tensors come back)")
    return value


def _swap_layers(value: Any, where: str, total: int) -> list[int]:
    if value is True:
        return list(range(total))
    if not isinstance(value, (list, tuple)) or not all(is_int(i) for i in value):
        raise TypeError(f"{where} layers = {value!r}; give a list of layer indices or True for all layers")
    bad = [i for i in value if not 0 <= i < total]
    if bad:
        raise ValueError(f"{where} layers {bad} out of range; the model has {total} layers (0..{total - 1})")
    return sorted(set(value))


def _entries(value: Any, key: str, allowed: tuple[str, ...]) -> list[Mapping[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, Mapping) for e in value):
        raise TypeError(f"swap_config.{key} must be a list of mappings with keys {list(allowed)}, got {value!r}")
    for i, entry in enumerate(value):
        unknown = [k for k in entry if k not in allowed]
        missing = [k for k in allowed if k not in entry and k != "backward_prefetch"]
        if unknown or missing:
            raise ValueError(f"swap_config.{key}[{i}] = {dict(entry)!r}: unknown keys {unknown}, missing keys "
                             f"{missing}; expected {list(allowed)}")
    return list(value)


def parse_config(config: ConfigSource, stages: Sequence[int], names: Optional[Sequence[str]] = None,
                 ranks: Optional[int] = None) -> RecomputeStrategy:
    """Normalises a recompute/swap config for a model of ``sum(stages)`` layers.

    Args:
        config: a path to a YAML file, a dict with ``recompute_config`` and/or
            ``swap_config`` sections, a bare ``recompute_config`` dict, or a
            :class:`RecomputeStrategy` (returned as is).
        stages: layers per stage (``Pipe``'s ``balance``).
        names: layer names for the log.
        ranks: pipeline ranks of a multi-process pipeline whose stage ``s``
            runs on rank ``s % ranks`` (``DistributedPipe``): with virtual
            stages, flat count lists may then give one count per rank, as
            MindFormers' ``pipeline_stage`` counts do (see :func:`_per_rank_counts`).

    Raises:
        ValueError / TypeError: bad keys, values, regexes, counts or lengths,
            with the value seen and the fix.
    """
    stages = list(stages)
    if not stages or any(not is_int(s) or s < 0 for s in stages):
        raise ValueError(f"stages must list the layers of each stage (ints >= 0), got {stages!r}")
    total = sum(stages)
    names = list(names) if names is not None else [str(i) for i in range(total)]
    if isinstance(config, RecomputeStrategy):
        if config.stages != stages:
            raise ValueError(f"this RecomputeStrategy was made for stages {config.stages}, not {stages}; "
                             "parse its to_config() again for these stages")
        return config
    if isinstance(config, (str, os.PathLike)):
        config = load_config(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"recompute config must be a path to a YAML file or a dict, got {type(config).__name__}")
    recompute_section, swap_section = _sections(config)

    unknown = [k for k in recompute_section if k not in RECOMPUTE_KEYS + MINDFORMERS_COMM_KEYS]
    if unknown:
        hint = " (put swap keys under swap_config)" if any(k in SWAP_KEYS for k in unknown) else ""
        raise ValueError(f"unknown recompute_config keys {unknown}; known keys: {list(RECOMPUTE_KEYS)}{hint}")
    comm = [k for k in MINDFORMERS_COMM_KEYS if recompute_section.get(k)]
    if comm:
        warnings.warn(f"recompute_config keys {comm} are about MindSpore's communication operators, which a "
                      "pipe layer does not have; they are ignored", stacklevel=3)
    unknown = [k for k in swap_section if k not in SWAP_KEYS]
    if unknown:
        raise ValueError(f"unknown swap_config keys {unknown}; known keys: {list(SWAP_KEYS)}")

    swap = swap_section.get("swap", False)
    if not isinstance(swap, bool):
        raise TypeError(f"swap_config.swap must be True or False, got {swap!r}")
    default_prefetch = _prefetch(swap_section.get("default_prefetch", 1), "swap_config.default_prefetch")
    min_bytes = swap_section.get("min_bytes", 1024)
    if not is_int(min_bytes) or min_bytes < 0:
        raise ValueError(f"swap_config.min_bytes = {min_bytes!r}; it must be an int >= 0")
    if not swap and any(swap_section.get(k) for k in ("layer_swap", "op_swap", "checkpoint_swap")):
        warnings.warn("swap_config has layer_swap/op_swap/checkpoint_swap but swap is False: nothing is "
                      "offloaded; set swap: True to enable them", stacklevel=3)

    if ranks is not None and (not is_int(ranks) or ranks < 1 or len(stages) % ranks):
        raise ValueError(f"ranks = {ranks!r} must be a positive int dividing the {len(stages)} stages")
    full = _layer_mask(recompute_section.get("recompute", False), "recompute", stages, swap, ranks)
    select = _select_masks(recompute_section.get("select_recompute", False), stages, swap, ranks)

    layer_swap: dict[int, int] = {}
    op_swap: dict[int, list[tuple[str, int]]] = {}
    checkpoint_swap: Optional[int] = None
    canonical_swap: dict[str, Any] = {"swap": swap}
    if swap:
        layer_entries = _entries(swap_section.get("layer_swap"), "layer_swap", ("backward_prefetch", "layers"))
        op_entries = _entries(swap_section.get("op_swap"), "op_swap", ("op_name", "backward_prefetch", "layers"))
        raw_checkpoint = swap_section.get("checkpoint_swap")
        if not layer_entries and not op_entries and raw_checkpoint is None:
            layer_entries = [{"backward_prefetch": default_prefetch, "layers": True}]  # the default strategy
        for i, entry in enumerate(layer_entries):
            where = f"swap_config.layer_swap[{i}]"
            prefetch = _prefetch(entry.get("backward_prefetch", default_prefetch), where)
            for layer in _swap_layers(entry["layers"], where, total):
                if layer in layer_swap:
                    raise ValueError(f"{where}: layer {layer} is already in another layer_swap entry; "
                                     "list each layer once")
                layer_swap[layer] = prefetch
        for i, entry in enumerate(op_entries):
            where = f"swap_config.op_swap[{i}]"
            pattern = entry["op_name"]
            compile_pattern(pattern, f"{where} op_name")
            prefetch = _prefetch(entry.get("backward_prefetch", default_prefetch), where)
            for layer in _swap_layers(entry["layers"], where, total):
                op_swap.setdefault(layer, []).append((pattern, prefetch))
        if raw_checkpoint is True:
            checkpoint_swap = default_prefetch
        elif isinstance(raw_checkpoint, Mapping):
            unknown = [k for k in raw_checkpoint if k != "backward_prefetch"]
            if unknown:
                raise ValueError(f"swap_config.checkpoint_swap keys {unknown} unknown; use "
                                 "{backward_prefetch: N} or True")
            checkpoint_swap = _prefetch(raw_checkpoint.get("backward_prefetch", default_prefetch),
                                        "swap_config.checkpoint_swap")
        elif raw_checkpoint not in (None, False):
            raise TypeError(f"swap_config.checkpoint_swap must be True/False or {{backward_prefetch: N}}, "
                            f"got {raw_checkpoint!r}")
        canonical_swap.update({
            "default_prefetch": default_prefetch,
            "layer_swap": [{"backward_prefetch": p, "layers": [l for l in sorted(layer_swap) if layer_swap[l] == p]}
                           for p in sorted(set(layer_swap.values()))],
            "op_swap": [{"op_name": pattern, "backward_prefetch": p,
                         "layers": sorted(l for l, ops in op_swap.items() if (pattern, p) in ops)}
                        for pattern, p in dict.fromkeys(e for ops in op_swap.values() for e in ops)],
            "checkpoint_swap": False if checkpoint_swap is None else {"backward_prefetch": checkpoint_swap},
            "min_bytes": min_bytes,
        })

    canonical = {"recompute_config": {
        "recompute": _canonical_mask(full, stages, swap),
        "select_recompute": {p: _canonical_mask(m, stages, swap) for p, m in select.items()},
    }, "swap_config": canonical_swap}

    layers = []
    stage_of = [s for s, size in enumerate(stages) for _ in range(size)]
    for i in range(total):
        chosen = tuple(p for p, m in select.items() if m[i])
        dropped = []
        if full[i] and chosen:
            dropped.append(f"select_recompute {list(chosen)} dropped: full recompute wins")
            chosen = ()
        swap_prefetch = layer_swap.get(i)
        ops = op_swap.get(i, [])
        if (full[i] or chosen) and (swap_prefetch is not None or ops):
            dropped.append("swap dropped: recompute wins over offload on the same layer")
            swap_prefetch, ops = None, []
        if swap_prefetch is not None and ops:
            dropped.append(f"op_swap {[p for p, _ in ops]} covered by the layer swap")
            ops = []
        layers.append(LayerStrategy(
            index=i, stage=stage_of[i], name=names[i], recompute=full[i], select=chosen, swap=swap_prefetch,
            op_swap=tuple(dict.fromkeys(p for p, _ in ops)),
            op_swap_prefetch=max((p for _, p in ops), default=None), dropped=tuple(dropped)))
    return RecomputeStrategy(stages=stages, layers=layers, swap=swap, default_prefetch=default_prefetch,
                             min_bytes=min_bytes, checkpoint_swap=checkpoint_swap, canonical=canonical)
