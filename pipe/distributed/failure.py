"""Failures across ranks: the rank that failed says so, the others say who failed and why.

When a layer raises on one rank, its peers are blocked in receives that will
never complete. Nothing can interrupt a blocked gloo or NCCL wait from the
outside, but the wait ends when the failed process exits (its connections
close) or when the process group's timeout expires. So the failing rank
writes "rank R failed in F3@1: ValueError: ..." to the job's key-value store
and re-raises; when its process ends (torchrun also stops the other workers),
every peer's wait fails, and the peer raises :class:`PipelineFailure` that
names the failed rank and its cause instead of a bare "connection closed".
``init_from_env`` sets a short process-group timeout so that a rank that
hangs instead of failing also ends the job in bounded time.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

__all__ = ["PipelineFailure", "report_failure", "reported_failures", "failure_from"]

logger = logging.getLogger(__name__)

_PREFIX = "pipe/failure/"


class PipelineFailure(RuntimeError):
    """This rank stopped because another rank of the pipeline failed."""


def _store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def report_failure(rank: int, where: str, error: BaseException) -> str:
    """Publishes that ``rank`` failed in ``where`` because of ``error``; returns the message."""
    message = f"rank {rank} failed in {where}: {type(error).__name__}: {error}"
    store = _store()
    if store is not None:
        try:
            store.set(f"{_PREFIX}{rank}", message)
        except Exception:  # the store itself may be gone; the local error is what matters
            logger.debug("could not publish the failure of rank %d", rank, exc_info=True)
    logger.error("%s", message)
    return message


def reported_failures(world: int, exclude: int) -> list[str]:
    """Failures published by other ranks, in rank order."""
    store = _store()
    if store is None:
        return []
    messages = []
    for rank in range(world):
        if rank == exclude:
            continue
        key = f"{_PREFIX}{rank}"
        try:
            if store.check([key]):
                messages.append(store.get(key).decode())
        except Exception:
            break  # the store went away with the rank that hosted it
    return messages


def failure_from(rank: int, where: str, error: BaseException) -> BaseException:
    """The exception this rank raises for ``error`` met in ``where``.

    If another rank reported a failure first, ``error`` is a consequence of it
    (a closed connection, a timeout), and the result is a
    :class:`PipelineFailure` naming that rank and its cause. Otherwise this
    rank is the one that failed: it reports and its own ``error`` is returned
    with a note naming the rank and the action.
    """
    others = reported_failures(dist.get_world_size(), exclude=rank) if dist.is_initialized() else []
    if others:
        failure = PipelineFailure(
            f"rank {rank} stopped in {where} because " + "; ".join(others)
            + f" (here: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )
        failure.__cause__ = error
        logger.error("%s", failure)
        return failure
    message = report_failure(rank, where, error)
    if hasattr(error, "add_note"):
        error.add_note(f"pipe.distributed: {message.split(':')[0]}")
    return error
