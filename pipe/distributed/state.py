"""Stage-agnostic training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank saves the state of the layers it owns under the plain model's
keys: the original ``nn.Sequential``'s (``"3.linear.weight"``) or, for a model
cut by :func:`pipe.split`, the split model's (a HuggingFace LLaMA's
``"model.layers.0.self_attn.q_proj.weight"``), and its optimizer's state
flattened per parameter under the same keys (``"state.3.linear.weight.exp_avg"``,
``"param_groups.3.linear.weight.lr"``). A tensor listed under several keys (a
tied weight: the embedding is the LM head, a replica on each holding rank) is
saved once, under the name the plain model's ``named_parameters()`` gives it,
and loaded into every replica. A checkpoint therefore does not remember how
the model was cut: a run with K stages resumes with K' stages (each rank reads
only its own keys), with more or fewer data-parallel replicas (replicas hold
the same keys, DCP writes them once), into ``pipe.Pipe``, or into the plain
module in one process (:func:`load_module`). torch's state-dict functions find
a tensor by walking the module from its key, which the stages of a split model
do not allow (``0.model.layers...``): they are given :func:`plain_view`, a
module that holds the same tensor objects under the plain keys.

Sharded stages save sharded: under a mesh with "dp_shard" (FSDP2) or "tp"
(tensor parallel), ``get_model_state_dict`` and ``get_optimizer_state_dict``
return ``DTensor`` shards under the same plain-model keys, every rank writes
only its shard, and the metadata records which slice of each tensor each file
holds. A load asks for the slices the loading rank's own ``DTensor``s (or
plain tensors) cover, so a checkpoint saved at one (pipeline, shard) layout
resumes at any other: (pp 2, dp_shard 2) -> (pp 4) or (pp 1, dp_shard 4),
bit for bit (tests/distributed/test_state_resharding.py; split HuggingFace
models through pipeline-only, replica, ZeRO-3, ZeRO-2, HSDP and
(pp 1, dp_shard 4) layouts: tests/distributed/test_state_split.py). Nothing is
gathered to one rank on either side.

A save is atomic: every rank writes into ``<path>.saving``, and once all
have finished (DCP writes the ``.metadata`` file last) that folder is renamed
to ``<path>``, replacing an older checkpoint there. A rank that dies during
a save therefore leaves the previous checkpoint at ``<path>`` intact and the
partial files in ``<path>.saving``, which :func:`load` names in its error.
A checkpoint is complete when its folder holds ``.metadata`` (:func:`is_complete`).

A rank that dies, stalls or raises during a save is named on every other rank
as in a step (``PipelineFailure: rank 0 stopped in state.save because rank 2
died: ...``, :func:`pipe.distributed.failure.naming_failures`), as fast: on
gloo, a save's collectives run on a group of their own (:func:`checkpoint_group`),
whose connections the ranks that named the failure shut down, so that no rank
waits for the timeout.

``save(..., asynchronous=True)`` copies the state to host memory and returns;
DCP's ``async_save`` writes the files in a background thread, over a gloo
group of its own, while training goes on. The rename that publishes the
checkpoint waits for every rank's write: :func:`wait`, which the next
:func:`save` and :func:`load` call first, and a run calls before it ends.
Until then the checkpoint is ``<path>.saving``, which :func:`latest` and
:func:`prune` pass over, so a rank that dies mid-write leaves the newest
published checkpoint the one to resume from. The background writes' group is
recorded as the checkpoints' too, and :func:`wait` is named as a save is
(``PipelineFailure: rank 0 stopped in state.wait because rank 2 died``): a
failure named there or in a save shuts the background group's connections
down as well, releasing a write still waiting on a lost rank.

A run that saves every N steps keeps its checkpoints as ``step-<8 digits>``
folders of one directory (:func:`step_path`): :func:`latest` finds the newest
complete one to resume from, and :func:`prune` deletes all but the newest k
complete ones, never a save still being written.

DCP is PyTorch's own format for this (parallel writes from every rank, a
metadata file, reads of any subset of keys); ``torch.distributed.checkpoint.format_utils``
converts it to a single ``torch.save`` file if needed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pipe.distributed.failure import naming_failures
from pipe.distributed.local_pieces import BlockLoadPlanner, BlockSavePlanner
from pipe.distributed.group import world_timeout
from pipe.distributed.materialize import mark_loaded
from pipe.distributed.mesh import reuse

__all__ = ["save", "wait", "load", "load_module", "model_state_dict", "is_complete", "step_path", "latest", "prune"]

logger = logging.getLogger(__name__)

Path = Union[str, "os.PathLike[str]"]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
STAGING = ".saving"
"""Suffix of the folder a save writes into before it is renamed to the checkpoint's path."""
STEP_PREFIX = "step-"
"""Name of a step checkpoint's folder before its step number (:func:`step_path`)."""
_STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"(\d+)")
_PRUNING = ".pruning"
"""Suffix a checkpoint's folder takes while :func:`prune` deletes it (not a checkpoint from the rename on)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _identity(tensor: Tensor) -> Any:
    """What makes two entries of a state dict one tensor: the same object, or the same memory viewed alike.

    (``Pipe`` lists a weight tied across devices under its other keys as a
    detached view of the one parameter, :mod:`pipe.core.tying`.)
    """
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.is_meta or local.numel() == 0:
        return id(tensor)
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            local.stride(), local.dtype)


def _canonical(key: str) -> str:
    """A state-dict key without the wrappers' prefixes (``torch.compile``'s, activation checkpointing's)."""
    return key.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


class _Holder(nn.Module):
    """A module of the view: holds tensors under one path of the plain model."""


class _WithExtraState(_Holder):
    """A module of the view standing for a module with ``get_extra_state`` (its state goes to and from it)."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.__dict__["_source"] = source  # not a submodule

    def get_extra_state(self) -> Any:
        return self.__dict__["_source"].get_extra_state()

    def set_extra_state(self, state: Any) -> None:
        self.__dict__["_source"].set_extra_state(state)


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside DDP's and ``torch.compile``'s wrappers (whose keys have a prefix of their own)."""
    while True:
        compiled = module._modules.get("_orig_mod") if type(module).__name__ == "OptimizedModule" else None
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        elif compiled is not None:  # torch.compile(module)
            module = compiled
        else:
            return module


def tensor_groups(module: nn.Module) -> list[tuple[list[str], Tensor]]:
    """Each tensor of ``module``'s state dict once, with every key it has there, the first first.

    A tensor listed under several keys (a tied weight) is one group; where a
    key lists a view of a parameter (``Pipe``'s tie across devices), the group
    holds the parameter itself, which the optimizer knows. FSDP's hooks give
    the sharded parameters.
    """
    groups: dict[Any, tuple[list[str], Tensor]] = {}
    for key, value in _unwrap(module).state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            continue
        identity = _identity(value)
        names, held = groups.setdefault(identity, ([], value))
        names.append(_canonical(key))
        if isinstance(value, nn.Parameter) and not isinstance(held, nn.Parameter):
            groups[identity] = (names, value)
    return list(groups.values())


def plain_view(module: nn.Module) -> nn.Module:
    """A module whose attribute paths are the plain model's names, holding ``module``'s own tensors.

    torch's ``get_model_state_dict`` and ``get_optimizer_state_dict`` (and
    ``set_...``) find a tensor by walking the module by attribute from its
    state-dict key. A ``DistributedPipe`` or ``Pipe`` lists the plain model's
    keys (``model.layers.0.self_attn.q_proj.weight``), which no attribute path
    leads to when the layers are stages of :func:`pipe.split` (``0.model...``
    inside a graph module). The view registers the very tensor objects (FSDP's
    and tensor parallelism's ``DTensor`` parameters included) under those keys,
    so those functions work on it as on the plain model, and loading into the
    view writes into ``module``'s tensors. A tensor listed under several keys
    (a tied weight: the embedding is the LM head) is held once, under the
    first key: the name the plain model's ``named_parameters()`` gives it.
    """
    module = _unwrap(module)
    entries: dict[str, Any] = {_canonical(key): value for key, value in module.state_dict(keep_vars=True).items()
                               if not isinstance(value, Tensor)}  # extra state
    entries.update((names[0], tensor) for names, tensor in tensor_groups(module))
    view = _Holder()
    modules: Optional[dict[str, nn.Module]] = None
    for key, value in entries.items():
        path, _, attr = key.rpartition(".")
        if attr == nn.modules.module._EXTRA_STATE_KEY_SUFFIX:
            if modules is None:
                modules = {_canonical(name): m for name, m in module.named_modules()}
            if path not in modules:
                raise NotImplementedError(f"state: cannot find the module of extra state {key!r}; save its module "
                                          "apart")
            _install(view, path, _WithExtraState(modules[path]))
            continue
        owner = _holder(view, path)
        if isinstance(value, nn.Parameter):
            owner.register_parameter(attr, value)
        else:
            owner.register_buffer(attr, value)
    return view


def _holder(view: nn.Module, path: str) -> nn.Module:
    owner = view
    for atom in path.split(".") if path else []:
        child = owner._modules.get(atom)
        if child is None:
            child = _Holder()
            owner.add_module(atom, child)
        owner = child
    return owner


def _install(view: nn.Module, path: str, module: nn.Module) -> None:
    """Puts ``module`` at ``path`` of the view, taking over what a holder there already has."""
    parent_path, _, name = path.rpartition(".")
    parent = _holder(view, parent_path)
    existing = parent._modules.get(name)
    if existing is not None:
        module._parameters.update(existing._parameters)
        module._buffers.update(existing._buffers)
        module._modules.update(existing._modules)
    parent.add_module(name, module)


def model_state_dict(module: nn.Module) -> dict[str, Any]:
    """This rank's model state under the plain model's keys, each tied weight once: what :func:`save` writes.

    The values are ``DTensor`` shards where the stages are sharded (FSDP2,
    tensor parallelism) and plain tensors elsewhere; they share memory with
    ``module``'s tensors, so writing into them (as ``torch.distributed.checkpoint.load``
    does) writes into ``module``. Keys are those of the model given to
    ``DistributedPipe`` or ``Pipe``: the ``nn.Sequential``'s (``"3.linear.weight"``)
    or, for a model cut by :func:`pipe.split`, the split model's
    (``"model.layers.0.self_attn.q_proj.weight"``).
    """
    return get_model_state_dict(plain_view(module), options=_OPTIONS)


def _state(module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[nn.Module, dict[str, Any]]:
    view = plain_view(module)
    state: dict[str, Any] = {"model": get_model_state_dict(view, options=_OPTIONS)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(view, optimizer, options=_OPTIONS)
    return view, state


@dataclass
class _Writing:
    """An asynchronous save in flight: DCP's future, and the folders to publish once every rank has written."""

    future: "Future[Any]"
    staging: str
    final: str
    tensors: int
    group: Optional[dist.ProcessGroup]  # the group it writes over (:func:`_background_group`), which wait() uses


_writing: Optional[_Writing] = None
"""The asynchronous save of this process still being written (at most one: a save waits for the one before)."""


def save(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         asynchronous: bool = False, **extra: Any) -> None:
    """Saves the model (and optimizer) state of every rank into the directory ``path``.

    Collective: every rank of the job calls it with its ``DistributedPipe``
    (or, in one process, the plain module).

    The keys are the plain model's (:func:`model_state_dict`): an
    ``nn.Sequential``'s, or for a model cut by :func:`pipe.split` the split
    model's, a tied weight once; so the checkpoint loads at any other layout,
    into ``pipe.Pipe`` and into the plain model (:func:`load_module`).

    A save in flight (``asynchronous=True`` before) is finished first (:func:`wait`).

    Args:
        path: a directory (created).
        module: a ``DistributedPipe``, a ``pipe.Pipe``, or the plain module (in one process).
        optimizer: the optimizer over ``module.parameters()``.
        asynchronous: return once the state is copied to host memory, and write the files in the background
            (``torch.distributed.checkpoint.async_save``, over a gloo group of its own so that its
            collectives never meet the training's): training goes on meanwhile and may change the weights.
            The checkpoint is published at ``path`` (complete, :func:`is_complete`; found by :func:`latest`)
            only when :func:`wait` has seen every rank's write finish; the next :func:`save`, :func:`load`
            and :func:`wait` do that. Call :func:`wait` before the end of the run, or the last checkpoint
            stays unpublished in ``<path>.saving``. Holds a copy of this rank's state in host memory while writing.
        extra: small values every rank agrees on (step number, an LR scheduler's ``state_dict()``, ...),
            returned by :func:`load` as given (a dict of them nested as it was).

    Raises:
        RuntimeError: the save in flight before this one failed (see :func:`wait`).
    """
    global _writing
    if not isinstance(asynchronous, bool):
        raise TypeError(f"state.save(asynchronous=...) must be True or False, got {asynchronous!r}")
    wait()
    final = os.fspath(path)
    staging = final + STAGING
    with saving("state.save") as group:
        _, state = _state(module, optimizer)
        state["extra"] = dict(extra)
        if _coordinator():
            shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        _barrier(group)
        if asynchronous and not _distributed():  # DCP's thread warns after the scope below: one process is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled.*to save in a single process",
                                    category=UserWarning)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            if asynchronous:
                background = _background_group()
                written = dcp.async_save(state, checkpoint_id=staging, process_group=background,
                                         no_dist=not _distributed(), planner=BlockSavePlanner())
                # An AsyncSaveResponse (a stager of one's own) holds the write's future; else it is the future.
                future = cast("Future[Any]", getattr(written, "upload_completion", written))
                _writing = _Writing(future, staging, final, len(state["model"]), background)
                logger.info("saving %d tensors of the model to %s in the background", len(state["model"]), path)
                return
            dcp.save(state, checkpoint_id=staging, no_dist=not _distributed(), process_group=group,
                     planner=BlockSavePlanner())
        _publish(staging, final, group)
    logger.info("saved %d tensors of the model to %s", len(state["model"]), path)


def wait() -> Optional[pathlib.Path]:
    """Finishes the asynchronous save in flight (:func:`save` with ``asynchronous=True``): waits, publishes it.

    Collective when ``torch.distributed`` is initialised (every rank has one
    save in flight or none alike). Once every rank's files are written, the
    save's folder is renamed to its path, as a synchronous save's is: only then is
    it a complete checkpoint (:func:`is_complete`, :func:`latest`, :func:`prune`).

    Returns:
        The path of the checkpoint published, or None when no save was in flight.

    Raises:
        RuntimeError: the write failed on a rank (named, with DCP's error); the
            partial files stay in ``<path>.saving``, never published, and the
            checkpoints published before are untouched.
        PipelineFailure: a rank died or stalled meanwhile (named as in a save:
            ``rank 0 stopped in state.wait because rank 2 died``); nothing is published.
    """
    global _writing
    writing, _writing = _writing, None
    if writing is None:
        return None
    with saving("state.wait"):
        error: Optional[BaseException] = None
        try:
            writing.future.result()
        except (Exception, dcp.CheckpointException) as failure:  # (a BaseException) reported on every rank below
            error = failure
        failed = _failed_ranks(error, writing.group)
        if failed:
            raise RuntimeError(
                f"the asynchronous save to {writing.final!r} failed on rank(s) {sorted(failed)}: "
                f"{'; '.join(f'rank {rank}: {why}' for rank, why in sorted(failed.items()))}; it was not published "
                f"(its partial files are in {writing.staging!r}) and the checkpoints saved before it are untouched: "
                f"resume from the newest of them (state.latest)") from error
        _publish(writing.staging, writing.final, writing.group)
    logger.info("saved %d tensors of the model to %s (written in the background)", writing.tensors, writing.final)
    return pathlib.Path(writing.final)


def _publish(staging: str, final: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Renames ``staging`` to ``final`` once every rank has written its files (DCP writes the metadata last)."""
    _barrier(group)
    if _coordinator():
        _replace(staging, final)
    _barrier(group)


def _coordinator() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _background_group() -> Optional[dist.ProcessGroup]:
    """A gloo group of every rank for the writes of asynchronous saves, or None in one process.

    Not :func:`checkpoint_group`: ``hf.save`` may run on that one while a write
    is in flight. Its connections are recorded as the checkpoints' (a failure
    named in a save or in :func:`wait` shuts them down); the next asynchronous
    save after a failed one gets a new group. Made on first use (collective).
    """
    if not _distributed():
        return None
    return reuse(("checkpoints", "background", _failed_saves), lambda: dist.new_group(backend="gloo"), "checkpoints")


def _failed_ranks(error: Optional[BaseException], group: Optional[dist.ProcessGroup]) -> dict[int, str]:
    """The ranks whose write failed and why, on every rank (one all-gather over the save's ``group``).

    DCP reports a rank's failed write on every rank (a ``CheckpointException`` naming the ranks); any other
    error names the rank that raised it.
    """
    local: dict[int, str] = {}
    rank = dist.get_rank() if _distributed() else 0
    if isinstance(error, dcp.CheckpointException):
        for failed, wrapped in error.failures.items():
            cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            local[failed] = f"{type(cause).__name__}: {cause}"
    elif error is not None:
        local[rank] = f"{type(error).__name__}: {error}"
    if not _distributed():
        return local
    gathered: list[Optional[dict[int, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local, group=group)
    return {failed: why for part in gathered if part for failed, why in part.items()}


def load(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Loads what :func:`save` wrote into ``module`` (and ``optimizer``), whatever the stages were.

    Collective when ``torch.distributed`` is initialised. Each rank reads the
    keys of the layers it owns. An asynchronous save in flight is finished first (:func:`wait`).

    Returns:
        The ``extra`` values given to :func:`save`.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (the message says
            whether a save into it was interrupted).
        RuntimeError: the checkpoint lacks a key this rank needs (DCP names it).
    """
    wait()
    _require_complete(os.fspath(path))
    view, state = _state(module, optimizer)
    # "extra" holds plain values whose keys the loader cannot know in advance: list them first.
    state["extra"] = _extra_skeleton(dcp.FileSystemReader(os.fspath(path)).read_metadata())
    with warnings.catch_warnings():
        # Loading in one process is intended here (load_module); DCP warns about it regardless.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=not _distributed(), planner=BlockLoadPlanner())
    set_model_state_dict(view, state["model"], options=_OPTIONS)
    if optimizer is not None:
        set_optimizer_state_dict(view, optimizer, state["optimizer"], options=_OPTIONS)
    mark_loaded(module)
    logger.info("loaded %d tensors of the model from %s", len(state["model"]), path)
    return dict(state["extra"])


def _extra_skeleton(metadata: Any) -> dict[str, Any]:
    """The ``extra`` values a checkpoint holds, as :func:`save` was given them (nested dicts nested), set to None.

    DCP stores a nested dict's leaves under flat keys (``extra.schedule.last_epoch``)
    and, in ``planner_data``, the path of each (``("extra", "schedule", "last_epoch")``),
    from which the nesting is rebuilt for DCP to fill in place.
    """
    skeleton: dict[str, Any] = {}
    paths = getattr(metadata, "planner_data", None) or {}
    for key in metadata.state_dict_metadata:
        if not key.startswith("extra."):
            continue
        found = paths.get(key)
        path = tuple(found[1:]) if found and all(isinstance(atom, str) for atom in found) else (key.split(".", 1)[1],)
        holder = skeleton
        for atom in path[:-1]:
            holder = holder.setdefault(atom, {})
        holder[path[-1]] = None
    return skeleton


def load_module(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Loads a checkpoint of a pipeline into the plain module, in a process without a process group.

    The same as :func:`load`; named apart for the reader: any number of
    stages on the saving side, one module on this one.
    """
    if _distributed():
        logger.debug("load_module with an initialised process group: every rank loads the whole module")
    return load(path, module, optimizer)


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint: a folder :func:`save` published (DCP's ``.metadata`` is in it).

    A save in progress, or one a failed rank interrupted, is ``<path>.saving``
    and not yet (or never) ``path``.
    """
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def step_path(directory: Path, step: int) -> pathlib.Path:
    """The folder of the checkpoint at ``step`` in a directory of step checkpoints: ``directory/step-00000042``.

    Save there with :func:`save`; :func:`latest` and :func:`prune` read these
    names (and only these) back. The number is zero-padded to 8 digits, so the
    names also sort by step as text.

    Raises:
        ValueError: ``step`` is not an integer >= 0.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step_path: step={step!r}; give the number of optimizer steps taken, an int >= 0")
    return pathlib.Path(os.fspath(directory)) / f"{STEP_PREFIX}{step:08d}"


def _step_checkpoints(directory: Path) -> list[tuple[int, pathlib.Path]]:
    """The complete step checkpoints in ``directory``, (step, path), the oldest first."""
    folder = pathlib.Path(os.fspath(directory))
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP_NAME.fullmatch(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(directory: Path) -> Optional[pathlib.Path]:
    """The newest complete checkpoint in a directory of step checkpoints (:func:`step_path`), or None.

    The newest is the one of the highest step. Folders without ``.metadata``
    (a save a failed rank interrupted: ``step-...saving``; a folder being
    pruned) and folders of other names are passed over. None when the
    directory holds no complete step checkpoint or does not exist (a run
    that has not saved yet).
    """
    found = _step_checkpoints(directory)
    return found[-1][1] if found else None


def prune(directory: Path, keep: int) -> list[pathlib.Path]:
    """Deletes the complete step checkpoints of ``directory`` but the newest ``keep``, and returns them.

    Only complete step checkpoints (:func:`step_path`, :func:`is_complete`) are
    deleted, the oldest first, so the newest complete one always stays, and a
    save being written (``step-...saving``) or any other folder is never
    touched. Each deleted folder is first renamed (``step-....pruning``), so
    a job that dies while deleting leaves no half-deleted checkpoint that
    :func:`latest` could return; the next ``prune`` clears such leftovers.

    Collective when ``torch.distributed`` is initialised: call it on every
    rank after :func:`save` has returned; rank 0 deletes and every rank returns
    the same list.

    Raises:
        ValueError: ``keep`` is not an integer >= 1.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune: keep={keep!r}; keep at least 1 checkpoint (an int >= 1): the newest complete one "
                         "is never deleted")
    doomed = [path for _, path in _step_checkpoints(directory)[:-keep]]
    _barrier()  # every rank has listed before rank 0 deletes
    if not _distributed() or dist.get_rank() == 0:
        folder = pathlib.Path(os.fspath(directory))
        for path in doomed:
            pruning = path.with_name(path.name + _PRUNING)
            os.rename(path, pruning)  # from here on not a checkpoint
            shutil.rmtree(pruning)
        for leftover in folder.glob(f"{STEP_PREFIX}*{_PRUNING}") if folder.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)
        if doomed:
            logger.info("pruned %d checkpoint(s) of %s, kept the newest %d", len(doomed), directory, keep)
    _barrier()
    return doomed


def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if _distributed():
        dist.barrier(group=group)


_failed_saves = 0  # saves that failed in this process: each failure shut its group's connections down


def checkpoint_group() -> Optional[dist.ProcessGroup]:
    """The group a save's collectives run on: on gloo a group of its own, else the default group (None).

    Its connections are shut down when a save fails
    (:func:`pipe.distributed.failure.naming_failures`), which the default group's
    must never be (a rebuilt pipeline agrees over it); the next save makes a
    new one. Made on first use (collective: every rank saves alike).
    """
    if not _distributed() or dist.get_backend() != "gloo":
        return None
    timeout = world_timeout()
    return reuse(("checkpoints", _failed_saves), lambda: dist.new_group(backend="gloo", timeout=timeout),
                 "checkpoints")


@contextlib.contextmanager
def saving(where: str) -> Iterator[Optional[dist.ProcessGroup]]:
    """The block of a save (``where``: ``"state.save"``, ``"hf.save"``) on :func:`checkpoint_group`, which it
    gives; a failure in it is named on every rank as in a step, and the next save gets a new group."""
    global _failed_saves
    if not _distributed():
        yield None
        return
    group = checkpoint_group()
    try:
        with naming_failures(where, world_timeout().total_seconds()):
            yield group
    except BaseException:
        _failed_saves += 1
        raise


def _replace(staging: str, final: str) -> None:
    """Renames the finished ``staging`` folder to ``final``, replacing an older checkpoint there."""
    old = final + ".replaced"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _require_complete(path: str) -> None:
    """Raises ``FileNotFoundError`` naming what is wrong unless ``path`` is a complete checkpoint."""
    if is_complete(path):
        return
    if not os.path.exists(path) and os.path.isdir(path + STAGING):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: a save into it did not finish (a rank failed during state.save; "
            f"its partial files are in {path + STAGING!r}); load an earlier checkpoint"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: the folder does not exist; pass the path given to "
                                "state.save")
    raise FileNotFoundError(
        f"{path!r} is not a complete checkpoint: it has no .metadata file (state.save writes it last, and "
        "publishes a checkpoint only once it is complete); pass the folder given to state.save, or load an "
        "earlier checkpoint"
    )
