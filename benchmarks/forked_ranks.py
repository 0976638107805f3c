"""Gloo ranks forked from a benchmark's process on 127.0.0.1, for the multi-process benchmarks.

The ranks start through the library's one way, :func:`pipe.distributed.local_ranks.run_local_ranks` (a free
port, a deadline, failures named by rank); each benchmark's rank function joins the process group itself, with
the timeout it needs.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from pipe.distributed.local_ranks import run_local_ranks


class _Results:
    """What a rank function ``put``s, kept in the rank (and returned by it)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


def _forked(rank: int, world: int, target: Callable[..., None], args: tuple[Any, ...]) -> list[Any]:
    results = _Results()
    target(rank, int(os.environ["MASTER_PORT"]), *args, results)
    return results.items


def run_forked_ranks(target: Callable[..., None], *args: Any, ranks: int = 2, timeout: float = 1800) -> list[Any]:
    """Runs ``target(rank, port, *args, results)`` in ``ranks`` forked processes; their results, by rank.

    Each rank puts one dict with a ``"rank"`` key into ``results`` (``results.put``).
    """
    per_rank = run_local_ranks(_forked, ranks, target, args, deadline=timeout, start_method="fork", init=False)
    return sorted((item for items in per_rank for item in items), key=lambda r: r["rank"])
