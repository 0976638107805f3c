"""HuggingFace model directories in and out of a pipeline, each rank reading and writing only its part.

:func:`load` fills a ``DistributedPipe`` (any mesh: "pp", "dp_replicate",
"dp_shard", "tp") or a plain module from a directory that ``save_pretrained``
wrote (``model.safetensors``, or shards named by
``model.safetensors.index.json``). The split model's names are the HF names
(:mod:`pipe.distributed.names`), so each rank looks up the keys of the
tensors it holds, and under FSDP2 or tensor parallelism reads only the bytes
of its own slice of each (safetensors stores every tensor contiguously:
:mod:`pipe.distributed.safetensors_files`). No rank reads, or holds, the
whole model.

:func:`save` writes such a directory from every rank at once: the ranks agree
on the files and their headers, then each writes the bytes of its own tensors
(its slices, for sharded ones) at their place in the files. A tensor that
several ranks hold (a replica, a tied embedding and LM head) is written once,
under the name ``from_pretrained`` expects (the first the plain model gives
it: ``model.embed_tokens.weight``, not ``lm_head.weight``). Like
:func:`pipe.distributed.state.save`, the export goes to ``<path>.saving`` and
is renamed to ``path`` once complete, and a rank that dies, stalls or raises
during it is named on every other rank as in a step.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from pipe.distributed import safetensors_files as files
from pipe.distributed.local_pieces import pieces
from pipe.distributed.materialize import mark_loaded
from pipe.distributed.state import STAGING, _replace, saving, tensor_groups
from pipe.split_stage import SplitStage

__all__ = ["load", "save", "tensor_parallel_plan", "LoadStats", "last_load"]

logger = logging.getLogger(__name__)

Path = Union[str, "os.PathLike[str]"]
_SHOWN = 8  # keys named in an error, per kind


@dataclass(frozen=True)
class LoadStats:
    """What this rank's last :func:`load` read.

    Attributes:
        keys: checkpoint tensors read (a slice of one counts once).
        bytes_read: bytes read from the safetensors files.
        bytes_held: bytes of the tensors (this rank's slices) that were filled.
        seconds: the load's wall time on this rank.
    """

    keys: int
    bytes_read: int
    bytes_held: int
    seconds: float


_last: Optional[LoadStats] = None


def last_load() -> Optional[LoadStats]:
    """The :class:`LoadStats` of this process's last :func:`load`, or None before any."""
    return _last


def load(path: Path, model: nn.Module, *, dtype: Optional[torch.dtype] = None) -> None:
    """Loads the HuggingFace model directory ``path`` into ``model``; each rank reads only what it holds.

    Collective when ``model`` is a ``DistributedPipe``: every rank of the job
    calls it. A plain module (or a ``pipe.Pipe``) is loaded by its process
    alone. Every persistent parameter and buffer the rank holds is
    overwritten (a model built on ``meta`` and materialised holds no stale
    value after it); non-persistent buffers (rotary ``inv_freq``) are left as
    construction made them. Tied weights are filled from the one key the
    checkpoint stores, on every rank that holds them.

    Args:
        path: a directory with ``model.safetensors`` or ``model.safetensors.index.json``
            and its shards (``config.json`` beside them is checked when present).
        model: a ``DistributedPipe`` of a model cut by :func:`pipe.split` (its names are
            the HF names), or the plain HF model.
        dtype: convert the model's floating-point tensors to this dtype first
            (not under FSDP or tensor parallelism: build the model in the dtype).
            Without it, the checkpoint's values are converted to the model's dtypes.

    Raises:
        FileNotFoundError: ``path`` is not a directory of safetensors weights.
        ValueError: keys the model needs are missing, the checkpoint has keys
            the model lacks, shapes differ, or ``config.json`` names another
            architecture; the message names the keys and the fix. Raised on
            every rank alike.
    """
    global _last
    started = time.perf_counter()
    directory = os.fspath(path)
    entries = files.directory(directory)
    config = _read_config(directory)
    _check_architecture(config, model, directory)
    if dtype is not None:
        _convert(model, dtype)
    collective = _collective(model)
    plan: list[tuple[str, files.Entry, Tensor]] = []
    names: list[str] = []
    missing: list[str] = []
    mismatched: list[str] = []
    for aliases, tensor in tensor_groups(model):
        if tensor.is_meta:
            raise ValueError(f"{aliases[0]} is on the meta device: give the model to DistributedPipe (which "
                             "allocates each rank's layers) or call to_empty(device=...) before loading")
        names += aliases
        key = next((name for name in aliases if name in entries), None)
        if key is None:
            missing.append(aliases[0])
        elif tuple(tensor.shape) != entries[key].shape:
            mismatched.append(f"{key}: checkpoint {list(entries[key].shape)}, model {list(tensor.shape)}")
        else:
            plan.append((key, entries[key], tensor))
    every = _gather((names, missing, mismatched), collective)
    unexpected = sorted(set(entries) - {name for held, _, _ in every for name in held})
    missing = sorted({name for _, lacking, _ in every for name in lacking})
    mismatched = sorted({line for _, _, lines in every for line in lines})
    if missing or unexpected or mismatched:
        foreign = not set(entries) & {name for held, _, _ in every for name in held}
        raise ValueError(_mismatch(directory, config, missing, unexpected, mismatched, foreign))
    read = held = 0
    with torch.no_grad():
        for key, entry, tensor in plan:
            for local, offset in pieces(tensor):
                read += files.read_into(entry, offset, local)
                held += local.numel() * local.element_size()
    mark_loaded(model)
    _last = LoadStats(len(plan), read, held, time.perf_counter() - started)
    logger.info("loaded %d tensors (%d bytes read for %d bytes held) from %s", len(plan), read, held, directory)


def save(path: Path, model: nn.Module, *, config: Any = None, max_shard_size: Union[int, str] = "2GB") -> None:
    """Writes ``model`` as a HuggingFace model directory that ``from_pretrained`` loads; each rank writes its part.

    Collective when ``model`` is a ``DistributedPipe``. Writes safetensors
    files of at most ``max_shard_size`` (a tensor larger than that gets a
    file of its own), ``model.safetensors.index.json`` when there are several,
    and ``config.json``. Nothing is gathered: each rank writes the bytes of the
    tensors (slices, under FSDP or tensor parallelism) it holds, and a tensor
    several ranks hold is written by one of them. The files are written into
    ``<path>.saving``, which is renamed to ``path`` when complete (replacing an
    older export): an interrupted export leaves the previous one intact.

    Args:
        path: the directory to write.
        model: a ``DistributedPipe`` of a model cut by :func:`pipe.split`, or the plain model.
        config: the model's ``PretrainedConfig`` (the plain model's ``config``
            before splitting), saved with its ``save_pretrained``; default: ``model.config``
            where the module has one. Without a config, ``from_pretrained`` needs one given.
            ``config.json`` states the dtype of the floating-point tensors written
            (of the first, in the plain model's order, if they differ, as
            ``save_pretrained`` does), whatever ``config.dtype`` says, so that
            ``from_pretrained(path)`` returns exactly these weights; ``config``
            itself is not changed (a copy is written).
        max_shard_size: bytes per file, a number or ``"2GB"``, ``"500MiB"``.
    """
    from pipe.core.units import parse_bytes

    try:
        limit = parse_bytes(max_shard_size)
    except ValueError:
        raise ValueError(f"max_shard_size must be a size such as '2GB' or '500MiB', or bytes; "
                         f"got {max_shard_size!r}") from None
    if config is None:
        config = getattr(model, "config", None)
    collective = _collective(model)
    rank = dist.get_rank() if collective else 0
    final = os.fspath(path)
    staging = final + STAGING
    with saving("hf.save") if collective else contextlib.nullcontext() as group:
        mine: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        held: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
        for aliases, tensor in tensor_groups(model):
            for local, offset in pieces(tensor):
                mine[aliases[0], offset] = local
                held.append((aliases[0], str(tensor.dtype), tuple(tensor.shape), offset, tuple(local.shape)))
        layout, writers = _layout(_gather(held, collective, group), _model_order(model), limit)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # what an interrupted export left
            os.makedirs(staging)
            _write_headers(staging, layout, config)
        _barrier(collective, group)
        entries = {key: entry for name, tensors in layout.items()
                   for key, entry in files.create(os.path.join(staging, name), tensors, write=False).items()}
        written = 0
        opened: dict[str, int] = {}
        try:
            for (key, offset), local in mine.items():
                if writers[key, offset] == rank:
                    entry = entries[key]
                    if entry.file not in opened:
                        opened[entry.file] = os.open(entry.file, os.O_WRONLY)
                    written += files.write_slice(entry, offset, local, opened[entry.file])
            for fd in opened.values():
                os.fsync(fd)  # on disk before the rename publishes the export
        finally:
            for fd in opened.values():
                os.close(fd)
        _barrier(collective, group)
        if rank == 0:
            _replace(staging, final)
        _barrier(collective, group)
    logger.info("exported %d bytes of the model to %s (%d tensors in %d files)", written, final, len(entries),
                len(layout))


# -- what a rank holds ---------------------------------------------------------------------------------


def tensor_parallel_plan(model: nn.Module, *, vocabulary: bool = False) -> dict[str, Any]:
    """The standard tensor-parallel plan of a HuggingFace model, for ``DistributedPipe(tensor_parallel=...)``.

    Read from the model's config (``base_model_tp_plan``, which transformers ships for LLaMA, Mistral, Qwen2,
    Qwen3 and most decoder families): attention's q, k, v and the MLP's gate and up projections split by output
    features (``ColwiseParallel``), o and down by input features (``RowwiseParallel``), under the plain
    model's names (``"model.layers.*.self_attn.q_proj"``). Where a config gathers a projection's output
    (``colwise_gather_output``: OLMo 2's q and k, normed over all heads; Phi-3's fused ``qkv_proj``) and slices
    the next one's input (``rowwise_split_input``), every rank runs the attention on all heads and only those
    weights are split (``ColwiseParallel(output_layouts=Replicate())``, ``RowwiseParallel(input_layouts=
    Replicate())``). The embedding and the LM head stay whole on each
    tensor-parallel rank (FSDP can still shard them) unless ``vocabulary`` (a config's ``embedding_rowwise``
    entry, which some transformers versions ship for LLaMA, is left to that choice). Works for the model as built and
    for its ``pipe.split`` stages alike.

    With ``vocabulary=True`` the input embedding's rows are split too
    (``RowwiseParallel(input_layouts=Replicate())``: each rank looks up the ids in its part of the vocabulary,
    the parts summed) and the LM head's output features (``ColwiseParallel(output_layouts=Replicate())``: the
    logits gathered), as torchtitan splits them. A tied embedding and head are split alike (the vocabulary's rows
    are the head's output features): a rank holds one ``DTensor`` of its rows, on one stage or on two.

    Usage::

        stages = pipe.split(model, (ids,), {"use_cache": False}, at=["model.layers.12"])
        piped = DistributedPipe(stages, mesh=make_mesh(pp=2, tp=2), tensor_parallel=hf.tensor_parallel_plan(model))

    GPT-2's config ships no plan; pipe's splits the same way: ``c_attn`` (q, k and v in one ``Conv1D``, each
    rank taking its heads of all three) and ``mlp.c_fc`` by output features, the two ``c_proj`` by input
    features.

    Raises:
        ValueError: the config has no such plan and pipe has none for its ``model_type``, an entry splits in a
            way other than by columns or rows.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    entries = getattr(config, "base_model_tp_plan", None) or _PLANS.get(str(getattr(config, "model_type", "")))
    if not entries:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan in its config (base_model_tp_plan), and pipe has "
            f"none for model_type {getattr(config, 'model_type', None)!r} (it has: {', '.join(sorted(_PLANS))}). "
            f"Give DistributedPipe(tensor_parallel=...) a plan of your own: {{module name pattern: "
            f"ColwiseParallel() or RowwiseParallel()}}")
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        prefix = ""
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        # the attention on all heads, on every rank; only the projections' weights split (OLMo 2, Phi-3)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}
    plan: dict[str, Any] = {}
    modules = [name for name, _ in model.named_modules() if name]
    for pattern, kind in entries.items():
        if kind == "replicated_with_grad_allreduce":  # a whole weight applied to split heads (Qwen3's q_norm):
            continue  # pipe sums its gradient over the tp ranks wherever the graph combines it with a split value
        if kind == "embedding_rowwise":  # the vocabulary split (transformers 5.17's LLaMA plan): vocabulary='s
            continue
        if kind not in styles:
            raise ValueError(
                f"{type(model).__name__}'s tensor-parallel plan splits {pattern!r} as {kind!r}; pipe splits "
                f"linear layers by columns or rows only ({', '.join(repr(k) for k in styles)}); give "
                f"DistributedPipe(tensor_parallel=...) a plan of your own without that entry")
        name = f"{prefix}.{pattern}" if prefix else pattern
        if not any(fnmatch.fnmatchcase(module, name) for module in modules):  # a config's plan covers variants:
            logger.info("tensor_parallel_plan: %s has no module %r; its entry is left out", type(model).__name__,
                        name)  # Qwen2-MoE's names a dense MLP, which its sparse layers do not have
            continue
        plan[name] = styles[kind]()
    if vocabulary:
        names = {id(module): name for name, module in model.named_modules()}
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
        plan[names[id(embedding)]] = RowwiseParallel(input_layouts=Replicate())
        plan[names[id(head)]] = ColwiseParallel(output_layouts=Replicate())
    return plan


# Plans for the model types whose config ships none, in base_model_tp_plan's form (under the base model).
_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
}


def _collective(model: nn.Module) -> bool:
    from pipe.distributed.distributed_pipe import DistributedPipe

    return isinstance(model, DistributedPipe) and dist.is_available() and dist.is_initialized()


def _model_order(model: nn.Module) -> dict[str, int]:
    """The plain model's keys in its order where the module knows them (a split model does), else none.

    (Without them the export keeps the ranks' order, which is the same on every rank.)
    """
    modules = (module for _, module in nn.Module.named_modules(model))  # a DistributedPipe's hides its stages
    stage = next((module for module in modules if isinstance(module, SplitStage)), None)
    return {key: i for i, key in enumerate(stage.model_keys)} if stage is not None else {}


def _gather(value: Any, collective: bool, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    if not collective:
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value, group=group)
    return every


def _barrier(collective: bool, group: Optional[dist.ProcessGroup] = None) -> None:
    if collective:
        dist.barrier(group=group)


def _convert(model: nn.Module, dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype such as torch.bfloat16, got {dtype}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"dtype={dtype} cannot convert a model sharded by FSDP or tensor parallelism; build the "
                         f"model in {dtype} (e.g. from_config(config, torch_dtype={dtype})) before DistributedPipe, "
                         "and load without dtype")
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None and tensor.is_floating_point():
                    tensor.data = tensor.data.to(dtype)


# -- the export's files --------------------------------------------------------------------------------


Pieces = Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
Files = dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]


def _layout(every: Sequence[Pieces], order: dict[str, int], limit: int
            ) -> tuple[Files, dict[tuple[str, tuple[int, ...]], int]]:
    """The files (name -> tensors in order) and the writer of each slice, the same on every rank."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    first: dict[str, tuple[int, int]] = {}
    writers: dict[tuple[str, tuple[int, ...]], int] = {}
    covered: dict[str, int] = {}
    for rank, held in enumerate(every):
        for position, (key, dtype, shape, offset, local) in enumerate(held):
            if tensors.setdefault(key, (dtype, shape)) != (dtype, shape):
                raise ValueError(f"ranks disagree on {key!r}: {tensors[key]} and {(dtype, shape)}; every rank "
                                 "must hold the same model (same config and dtype)")
            first.setdefault(key, (rank, position))
            if (key, offset) not in writers:
                writers[key, offset] = rank
                covered[key] = covered.get(key, 0) + math.prod(local)
    for key, (_, shape) in tensors.items():
        if covered[key] != math.prod(shape):
            raise ValueError(f"the ranks' slices of {key!r} cover {covered[key]} of its {math.prod(shape)} elements; "
                             "hf.save writes the blocks of DTensors sharded evenly")
    keys = sorted(tensors, key=lambda key: (order.get(key, len(order)), first[key]))
    chunks: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for key in keys:
        dtype = getattr(torch, tensors[key][0].removeprefix("torch."))
        shape = tensors[key][1]
        nbytes = math.prod(shape) * dtype.itemsize
        if chunks[-1] and size + nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append((key, dtype, shape))
        size += nbytes
    if len(chunks) == 1:
        return {files.SINGLE: chunks[0]}, writers
    count = len(chunks)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": chunk for i, chunk in enumerate(chunks)}, writers


def _write_headers(staging: str, layout: Files, config: Any) -> None:
    for name, tensors in layout.items():
        files.create(os.path.join(staging, name), tensors)
    if len(layout) > 1:
        weight_map = {key: name for name, tensors in layout.items() for key, _, _ in tensors}
        total = sum(math.prod(shape) * dtype.itemsize for tensors in layout.values() for _, dtype, shape in tensors)
        with open(os.path.join(staging, files.INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if config is not None:
        _stamped(config, layout).save_pretrained(staging)
    else:
        logger.warning("hf.save without config: %s has no config.json, so from_pretrained needs the config given; "
                       "pass config=<the model's PretrainedConfig>", staging)


def _stamped(config: Any, layout: Files) -> Any:
    """``config`` with the ``dtype`` of the floating-point tensors written, in a copy (as ``save_pretrained`` sets it).

    ``from_pretrained(path)`` builds the model in ``config.json``'s ``dtype``:
    a config that still says bfloat16 (the source checkpoint's) over float32
    tensors would return the trained weights rounded. ``layout`` is every
    rank's tensors, in the files' order (the plain model's). Mixed dtypes: the
    first floating-point tensor's, as ``save_pretrained`` takes the model's
    first floating-point parameter's. The caller's config is not changed.
    """
    written = next((dtype for tensors in layout.values() for _, dtype, _ in tensors if dtype.is_floating_point), None)
    if written is None or getattr(config, "dtype", None) == written:
        return config
    stamped = copy.deepcopy(config)
    stamped.dtype = written
    return stamped


# -- refusals ------------------------------------------------------------------------------------------


def _read_config(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, "config.json")) as f:
            config: dict[str, Any] = json.load(f)
            return config
    except FileNotFoundError:
        return {}


def _describe(config: dict[str, Any]) -> str:
    if not config:
        return "no config.json"
    return f"{'/'.join(config.get('architectures') or ['?'])} (model_type {config.get('model_type', '?')!r})"


def _check_architecture(config: dict[str, Any], model: nn.Module, directory: str) -> None:
    """A plain HF model whose ``model_type`` is not the directory's is refused (a split model's is not known)."""
    own = getattr(getattr(model, "config", None), "model_type", None)
    if own and config.get("model_type") and own != config["model_type"]:
        raise ValueError(f"{directory!r} holds a {_describe(config)} checkpoint, but the model is a "
                         f"{type(model).__name__} (model_type {own!r}); load a checkpoint of this architecture, or "
                         f"build the model from the directory's config (AutoConfig.from_pretrained)")


def _mismatch(directory: str, config: dict[str, Any], missing: list[str], unexpected: list[str],
              mismatched: list[str], foreign: bool) -> str:
    def shown(keys: list[str]) -> str:
        return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")

    lines = [f"cannot load {directory!r} ({_describe(config)}) into this model:"]
    if missing:
        lines.append(f"- {len(missing)} tensors the model holds are not in the checkpoint: {shown(missing)}")
    if unexpected:
        lines.append(f"- {len(unexpected)} tensors of the checkpoint are not in the model: {shown(unexpected)}")
    if mismatched:
        lines.append(f"- {len(mismatched)} shapes differ: {shown(mismatched)}")
    if foreign:
        lines.append("- no key of the checkpoint is one of the model's: another architecture")
    lines.append("Fix: build the model from the checkpoint's own config (AutoConfig.from_pretrained(path), then "
                 "from_config and pipe.split), so that its names and shapes are the checkpoint's")
    converted = _converted_on_load(config)
    if converted and (missing or unexpected):
        lines.append(
            f"Or, for a directory save_pretrained wrote: transformers keeps {converted} checkpoints in their original "
            "layout (a mixture of experts' tensors one per expert) and converts them as from_pretrained loads "
            "(renamed, merged into one tensor per layer); hf.load reads the model's own layout, which "
            "from_pretrained(path).save_pretrained(out, save_original_format=False) writes once")
    return "\n".join(lines)


def _converted_on_load(config: dict[str, Any]) -> str:
    """The architecture (class or ``model_type``) whose tensors transformers renames or merges as it loads a
    checkpoint (its checkpoint conversion mapping: Mixtral's and Qwen2-MoE's experts); '' for none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4, or none: no conversion on load
        return ""
    for name in [*(config.get("architectures") or []), config.get("model_type")]:
        if isinstance(name, str) and get_checkpoint_conversion_mapping(name):
            return name
    return ""
