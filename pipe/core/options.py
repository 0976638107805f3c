"""Argument checks shared by the front ends (``Pipe``, ``DistributedPipe``) and ``pipe-viz``.

Each check names the argument, the value it got and how to fix it, so that
the same mistake reads the same from every entry point. Only the entry points
that take a user's values import this module: the two front ends,
``pipe-viz``, ``pipe.balance``, ``pipe.batchnorm`` and the recompute config
reader; the runners below them take checked values.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Iterable

from pipe.core.schedule import Schedule

__all__: list[str] = []

CHECKPOINT_MODES = ("always", "except_last", "never")
#: What FSDP gathers at a time (``pipe.distributed.Shard(unit=...)``), and when a layer's gradients are
#: reduce-scattered (``Shard(reduce=...)``): here, where the planner's model reads them without torch.
UNITS = ("stage", "block")
REDUCES = ("step", "micro-batch")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, meaning: str) -> int:
    """``value`` if it is a positive int, else ``ValueError`` naming ``name`` and what it counts."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {value!r}")
    return int(value)


def checkpoint_stop(mode: str, chunks: int) -> int:
    """How many leading micro-batches a checkpoint mode checkpoints."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def verify_chunks(chunks: Any) -> int:
    """``chunks`` as an int: an int, an integer-valued float (``8.0``) or any integer type (``numpy.int64``).

    torchgpipe, fairscale and torch's ``Pipe`` took ``int(chunks)``; a float
    with a fraction would then lose it without a word, so it is refused here.
    """
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    elif not is_int(chunks) and not isinstance(chunks, bool) and hasattr(chunks, "__index__"):
        try:
            chunks = operator.index(chunks)
        except TypeError:
            pass  # refused below, with the value
    if not is_int(chunks):
        hint = ""
        if isinstance(chunks, float):
            hint = f"; pass int(chunks) if {int(chunks)} micro-batches is what you meant"
        elif isinstance(chunks, (list, tuple)):
            hint = (f"; a list in this place was torchgpipe's and fairscale's balance, "
                    f"which is keyword-only here: pass balance={list(chunks)!r}")
        raise TypeError(f"chunks must be an int (the number of micro-batches), got {chunks!r}{hint}")
    if chunks <= 0:
        raise ValueError(f"chunks must be a positive int, got {chunks}; use chunks=1 for no micro-batching")
    return int(chunks)


def verify_checkpoint(checkpoint: Any) -> str:
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint must be one of {', '.join(repr(m) for m in CHECKPOINT_MODES)}, got {checkpoint!r}"
        )
    return str(checkpoint)


def pipeline_schedule(kind: Any, ranks: int, chunks: int, virtual_stages: Any) -> Schedule:
    """``Schedule(kind, ranks, chunks, virtual_stages)``, its errors worded in the front end's arguments.

    ``pipe.core.schedule`` speaks of ``microbatches`` and ``ranks``; a user of
    ``DistributedPipe`` passed ``chunks`` and runs a number of pipeline ranks.

    A :class:`Schedule` given as ``kind`` (a table of your own,
    :mod:`pipe.core.schedule_table`) is used as it is, once its ranks and
    micro-batches are checked against the job's and ``chunks``.

    Raises:
        ValueError: naming ``schedule=``, ``chunks=`` or ``virtual_stages=`` and the fix.
    """
    if isinstance(kind, Schedule):
        if kind.ranks != ranks or kind.microbatches != chunks:
            raise ValueError(
                f"the schedule {kind} is for {kind.ranks} ranks and {kind.microbatches} micro-batches, but this "
                f"job has {ranks} pipeline ranks and chunks={chunks}; pass chunks={kind.microbatches} and run "
                f"{kind.ranks} pipeline ranks, or a table of that size")
        if virtual_stages != 1 and virtual_stages != kind.virtual_stages:
            raise ValueError(f"virtual_stages={virtual_stages} does not apply to a schedule given as a table: "
                             "its stages are the table's; leave virtual_stages out")
        return kind
    if kind == "interleaved" and is_int(chunks) and is_int(ranks) and ranks > 0 and chunks % ranks != 0:
        lower = chunks // ranks * ranks or ranks
        raise ValueError(
            f"schedule='interleaved' needs chunks divisible by the pipeline ranks (got chunks={chunks}, "
            f"{ranks} pipeline ranks): each rank takes the micro-batches in groups of {ranks}; "
            f"use chunks={lower} or chunks={lower + ranks}"
        )
    try:
        return Schedule(kind, ranks=ranks, microbatches=chunks, virtual_stages=virtual_stages)
    except ValueError as error:
        message = str(error).replace("unknown schedule kind", "unknown schedule").replace(
            "microbatches", "chunks").replace("kind='interleaved'", "schedule='interleaved'")
        raise ValueError(message) from None


def verify_one_value_layers(layers: Iterable[tuple[str, Any]]) -> None:
    """Refuses, in an ``nn.Sequential``, a layer whose ``forward`` needs several arguments.

    An ``nn.Sequential`` hands each layer one value (a returned tuple stays one
    argument), so such a layer cannot run in the plain model either; the
    model was written for torch's ``Pipe`` convention, which is
    :class:`pipe.PipeSequential`'s.

    Raises:
        TypeError: names the layer, its arguments and the fix.
    """
    for name, layer in layers:
        try:
            parameters = inspect.signature(layer.forward).parameters.values()
        except (TypeError, ValueError):  # no signature to read: let the call decide
            continue
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
            continue
        required = [p.name for p in parameters if p.default is inspect.Parameter.empty
                    and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if len(required) > 1:
            raise TypeError(
                f"layer {name} ({type(layer).__name__}) takes {len(required)} arguments ({', '.join(required)}), "
                "but an nn.Sequential passes one value from layer to layer (a returned tuple stays one argument), "
                "so the plain model cannot run it either. For torch's Pipe convention (a returned tuple becomes the "
                "next layer's arguments) wrap the model in pipe.PipeSequential: "
                "Pipe(PipeSequential(OrderedDict(model.named_children())), ...)"
            )
