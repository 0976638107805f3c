"""Stage-agnostic training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank saves the state of the layers it owns under the original
``nn.Sequential``'s keys (``"3.linear.weight"``), and its optimizer's state
flattened per parameter under the same keys (``"state.3.linear.weight.exp_avg"``,
``"param_groups.3.linear.weight.lr"``). A checkpoint therefore does not
remember how the model was cut: a run with K stages resumes with K' stages (each
rank reads only its own keys), with more or fewer data-parallel replicas
(replicas hold the same keys, DCP writes them once), or into the plain module
in one process (:func:`load_module`).

Sharded stages save sharded: under a mesh with "dp_shard" (FSDP2) or "tp"
(tensor parallel), ``get_model_state_dict`` and ``get_optimizer_state_dict``
return ``DTensor`` shards under the same plain-model keys, every rank writes
only its shard, and the metadata records which slice of each tensor each file
holds. A load asks for the slices the loading rank's own ``DTensor``s (or
plain tensors) cover, so a checkpoint saved at one (pipeline, shard) layout
resumes at any other: (pp 2, dp_shard 2) -> (pp 4) or (pp 1, dp_shard 4),
bit for bit (tests/distributed/test_state_resharding.py). Nothing is gathered
to one rank on either side.

A save is atomic: every rank writes into ``<path>.saving``, and once all
have finished (DCP writes the ``.metadata`` file last) that folder is renamed
to ``<path>``, replacing an older checkpoint there. A rank that dies during
a save therefore leaves the previous checkpoint at ``<path>`` intact and the
partial files in ``<path>.saving``, which :func:`load` names in its error.

DCP is PyTorch's own format for this (parallel writes from every rank, a
metadata file, reads of any subset of keys); ``torch.distributed.checkpoint.format_utils``
converts it to a single ``torch.save`` file if needed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from typing import Any, ContextManager, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["save", "load", "load_module"]

logger = logging.getLogger(__name__)

Path = Union[str, "os.PathLike[str]"]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
STAGING = ".saving"
"""Suffix of the folder a save writes into before it is renamed to the checkpoint's path."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _own_names(module: nn.Module) -> ContextManager[None]:
    """DCP walks the module by attribute from ``named_parameters()``: a DistributedPipe's own names meanwhile."""
    names = getattr(module, "plain_names", None)
    return names.raw() if names is not None else contextlib.nullcontext()


def _state(module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    with _own_names(module):
        state: dict[str, Any] = {"model": get_model_state_dict(module, options=_OPTIONS)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    return state


def save(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **extra: Any) -> None:
    """Saves the model (and optimizer) state of every rank into the directory ``path``.

    Collective: every rank of the job calls it with its ``DistributedPipe``
    (or, in one process, the plain module).

    Args:
        path: a directory (created).
        module: a ``DistributedPipe`` or any module whose keys are the original model's.
        optimizer: the optimizer over ``module.parameters()``.
        extra: small values every rank agrees on (step number, ...), returned by :func:`load`.
    """
    state = _state(module, optimizer)
    state["extra"] = dict(extra)
    final = os.fspath(path)
    staging = final + STAGING
    coordinator = not _distributed() or dist.get_rank() == 0
    if coordinator:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, checkpoint_id=staging, no_dist=not _distributed())
    _barrier()  # every rank's files and the metadata are written
    if coordinator:
        _replace(staging, final)
    _barrier()
    logger.info("saved %d tensors of the model to %s", len(state["model"]), path)


def load(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Loads what :func:`save` wrote into ``module`` (and ``optimizer``), whatever the stages were.

    Collective when ``torch.distributed`` is initialised. Each rank reads the
    keys of the layers it owns.

    Returns:
        The ``extra`` values given to :func:`save`.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (the message says
            whether a save into it was interrupted).
        RuntimeError: the checkpoint lacks a key this rank needs (DCP names it).
    """
    _require_complete(os.fspath(path))
    state = _state(module, optimizer)
    # "extra" holds plain values whose keys the loader cannot know in advance: list them first.
    metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    extra_keys = [key for key in metadata.state_dict_metadata if key.startswith("extra.")]
    state["extra"] = {key.split(".", 1)[1]: None for key in extra_keys}
    with warnings.catch_warnings():
        # Loading in one process is intended here (load_module); DCP warns about it regardless.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=not _distributed())
    with _own_names(module):
        set_model_state_dict(module, state["model"], options=_OPTIONS)
        if optimizer is not None:
            set_optimizer_state_dict(module, optimizer, state["optimizer"], options=_OPTIONS)
    logger.info("loaded %d tensors of the model from %s", len(state["model"]), path)
    return dict(state["extra"])


def load_module(path: Path, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Loads a checkpoint of a pipeline into the plain module, in a process without a process group.

    The same as :func:`load`; named apart for the reader: any number of
    stages on the saving side, one module on this one.
    """
    if _distributed():
        logger.debug("load_module with an initialised process group: every rank loads the whole module")
    return load(path, module, optimizer)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


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
    if os.path.isfile(os.path.join(path, ".metadata")):
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
