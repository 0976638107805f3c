"""Two gloo ranks forked from a benchmark's process on 127.0.0.1, for the multi-process benchmarks."""
from __future__ import annotations

import multiprocessing
import socket
from typing import Any, Callable


def run_forked_ranks(target: Callable[..., None], *args: Any, ranks: int = 2, timeout: float = 1800) -> list[Any]:
    """Runs ``target(rank, port, *args, results)`` in ``ranks`` forked processes; their results, by rank.

    Each rank puts one dict with a ``"rank"`` key into ``results``.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    results: "multiprocessing.Queue[Any]" = context.Queue()
    processes = [context.Process(target=target, args=(rank, port, *args, results)) for rank in range(ranks)]
    for process in processes:
        process.start()
    collected = sorted((results.get(timeout=timeout) for _ in processes), key=lambda r: r["rank"])
    for process in processes:
        process.join()
    return collected
