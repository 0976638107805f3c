"""The transport between two ranks, measured once per machine: seconds per message and per byte.

:func:`measure_link` starts two fresh processes
(:func:`pipe.distributed.local_ranks.run_local_ranks`) that join a gloo group on
127.0.0.1, as ``DistributedPipe``'s ranks on one machine do, and bounce
messages of several sizes between them (ping-pong: one way is half a round
trip). The fastest round trip of each size is kept (time lost to other
processes is not the transport's cost), and a line ``latency + bytes x
per_byte`` is fitted to them by least squares. The same two processes then
time steps of a ``DistributedPipe`` whose layers take no time (GPipe, 8
micro-batches): what is left is the runner's overhead per action
(:attr:`Link.action_overhead`), the default of the time model. Last, they
time steps of the same kind of model sharded over both (``pp 1 x dp_shard
2``) with 2 and 8 layers: the time per layer beyond the link's latency is
FSDP's overhead per gather or reduce-scatter of a group
(:attr:`Link.collective_overhead`), and what the 2-layer step takes beyond
its collectives and actions its overhead per sharded stage and step
(:attr:`Link.shard_step_overhead`); a step of 2 wide layers (4 MiB each)
gives FSDP's cost per byte beyond the link's (:attr:`Link.collective_per_byte`:
its copies into and out of flat buffers, and the reduction). They also time all-reduces of several
sizes as the replicas' averager makes them (gradients copied into a flat
buffer, all-reduced, divided, copied back; 64 KiB to 32 MiB, beyond the
caches): gloo reduces on the CPU, so this costs several times a message's
bytes (:attr:`Link.reduce_latency`, :attr:`Link.reduce_per_byte`; HSDP's
in-place all-reduce is charged the same, a little more than it costs).

:func:`cached_link` returns the figures measured earlier on this machine, or
measures and stores them: a JSON file in ``$PIPE_CACHE_DIR`` (default
``~/.cache/pipe``), keyed by host name, CPU count, torch version and backend,
so another machine or another torch measures again. The thread runner
(``Pipe``) has no link, but an overhead per action of its own:
:func:`measure_thread_overhead` times it in this process, the same way, and
:func:`cached_thread_overhead` keeps it in the same file.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pipe.plan.timing import Link

__all__: list[str] = []

logger = logging.getLogger(__name__)

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
"""Message sizes in bytes sent by :func:`measure_link` (1 KiB to 4 MiB)."""

REDUCE_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 25)
"""Gradient bytes averaged by :func:`measure_link` (64 KiB to 32 MiB: larger than the caches, as a stage's)."""


def link_key(backend: str = "gloo") -> str:
    import torch

    return f"{socket.gethostname()}|cpus={os.cpu_count()}|torch={torch.__version__}|{backend}|{platform.machine()}"


def cache_path() -> Path:
    return Path(os.environ.get("PIPE_CACHE_DIR") or Path.home() / ".cache" / "pipe") / "link.json"


def peer(rank: int, world: int, sizes: Sequence[int], repeats: int) -> Any:
    """One of :func:`measure_link`'s two ranks (:func:`pipe.distributed.local_ranks.run_local_ranks`): its
    timings."""
    import gc

    import torch
    import torch.distributed as dist

    best: dict[int, float] = {}
    for _ in range(repeats + 1):  # the first round warms up the connection
        for size in sizes:
            buffer = torch.empty(size, dtype=torch.uint8)
            dist.barrier()
            begun = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            elapsed = (time.perf_counter() - begun) / 2
            best[size] = min(best.get(size, math.inf), elapsed)
    reduced: dict[int, float] = {}
    for _ in range(repeats + 1):
        for size in REDUCE_SIZES:
            reduced[size] = min(reduced.get(size, math.inf), _averaged(size))
    step = _empty_step(rank)
    sharded = {layers: _sharded_step(layers) for layers in SHARDED_LAYERS}
    wide = _sharded_step(2, WIDE)
    gc.collect()  # the sharded pipelines' groups go before the default group
    return best, step, sharded, reduced, wide


def _averaged(nbytes: int) -> float:
    """Seconds the replicas' averager (:class:`pipe.distributed.data_parallel.GradientAverager`) takes to
    average a stage's ``nbytes`` of gradients (two tensors) over the 2 ranks: copied into one flat buffer,
    all-reduced, divided, copied back."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipe.distributed.data_parallel import GradientAverager

    stage = nn.Module()
    for name in ("a", "b"):
        weight = nn.Parameter(torch.zeros(nbytes // 8))
        weight.grad = torch.zeros_like(weight)
        stage.register_parameter(name, weight)
    averager = GradientAverager({0: stage}, None, 2)
    dist.barrier()
    begun = time.perf_counter()
    averager.start(0)
    averager.finish()
    return time.perf_counter() - begun


OVERHEAD_PLAN = ("gpipe", 8)
"""The plan whose step measures the runner's overhead per action: a model too small to take time."""


def _fastest(step: Callable[[], Any], steps: int = 8, warm: int = 2) -> float:
    """The fastest of ``steps`` calls of ``step`` after the first ``warm``, in seconds."""
    times = []
    for _ in range(steps):
        begun = time.perf_counter()
        step()
        times.append(time.perf_counter() - begun)
    return min(times[warm:])


def _fastest_step(model: Any, rows: int, width: int = 4) -> float:
    """The fastest of 6 steps (after 2 to warm up) of ``model`` on zeros of ``rows`` x ``width``."""
    import torch
    from torch import nn

    x, y = torch.zeros(rows, width), torch.zeros(rows, width)
    return _fastest(lambda: model.step(x, y, nn.functional.mse_loss))


def _empty_step(rank: int) -> float:
    """The fastest of a few steps of a 2-rank ``DistributedPipe`` whose layers take no time."""
    from torch import nn

    from pipe.distributed import DistributedPipe

    kind, chunks = OVERHEAD_PLAN
    model = DistributedPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=chunks, balance=[1, 1],
                            checkpoint="never", schedule=kind)
    return _fastest_step(model, chunks)


SHARDED_LAYERS = (2, 8)
"""Layers of the sharded models whose steps measure FSDP's overheads (``pp 1 x dp_shard 2``, GPipe, 1 micro-batch)."""
_TINY_LAYER_BYTES = (4 * 4 + 4) * 4  # nn.Linear(4, 4) in float32
WIDE = 1024
"""Width of the 2 square layers (4 MiB each, beyond the caches) whose sharded step measures FSDP's cost per byte."""


def _layer_bytes(width: int) -> int:
    return (width * width + width) * 4  # nn.Linear(width, width) in float32


def _sharded_step(layers: int, width: int = 4) -> float:
    """The fastest of a few steps of ``layers`` layers ``width`` wide (4: tiny) sharded over the 2 ranks
    (pp 1 x dp_shard 2), on one sample: the collectives are the step."""
    import torch
    from torch import nn

    from pipe.distributed import DistributedPipe, make_mesh

    torch.manual_seed(0)  # shard partners start alike (DistributedPipe checks it)
    model = DistributedPipe(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), chunks=1,
                            schedule="gpipe", checkpoint="never", mesh=make_mesh(pp=1, dp_shard=2))
    return _fastest_step(model, 1, width)


def _sharding_overheads(link: Link, steps: dict[int, float]) -> tuple[float, float]:
    """``(collective_overhead, shard_step_overhead)`` from the sharded steps of :data:`SHARDED_LAYERS` layers.

    A layer adds one gather and one reduce-scatter of one ring step each (2 ranks); the step of the
    fewest layers, less its collectives and its two actions, is the overhead per sharded stage and step.
    """
    few, many = SHARDED_LAYERS
    per_layer = max(steps[many] - steps[few], 0.0) / (many - few)
    collective = max(per_layer / 2 - link.cost(_TINY_LAYER_BYTES // 2), 0.0)
    rest = steps[few] - few * 2 * (link.cost(_TINY_LAYER_BYTES // 2) + collective) - 2 * link.action_overhead
    return collective, max(rest, 0.0)


def _sharding_per_byte(link: Link, tiny: float, wide: float) -> float:
    """FSDP's seconds per byte of a ring step beyond the link's, from the steps of 2 tiny and 2 wide layers
    (each layer: one gather and one reduce-scatter of half its bytes on 2 ranks; the compute of one sample
    is left in, a few percent of it)."""
    part = _layer_bytes(WIDE) // 2
    per_step = (wide - tiny) / (2 * 2) - (link.cost(part) - link.cost(_TINY_LAYER_BYTES // 2))
    return max(per_step / part, 0.0)


def _overhead(link: Optional[Link], step: float, runner: str = "processes") -> float:
    """The overhead per action that makes the empty plan's predicted step on ``runner`` the measured one."""
    from pipe.plan.cost import Costs
    from pipe.plan.candidate import Candidate
    from pipe.plan.predict import predict
    from pipe.plan.timing import TimeModel

    kind, chunks = OVERHEAD_PLAN
    costs = Costs.from_table(chunks, [0.0, 0.0], [0.0, 0.0], [0, 0], [16, 16], chunks=(chunks,))
    plan = Candidate(kind, chunks, (1, 1), "never")
    low, high = 0.0, step
    for _ in range(50):
        middle = (low + high) / 2
        predicted = predict(costs, plan, runner=runner, timeline=False,
                            model=TimeModel(link=link, action_overhead=middle)).step_time
        low, high = (middle, high) if predicted < step else (low, middle)
    return (low + high) / 2


def measure_thread_overhead() -> float:
    """Seconds per action that ``Pipe``'s thread runner spends beyond its layers (a second or two).

    A ``Pipe`` of two one-layer partitions too small to take time (one
    intra-op thread each, GPipe at 8 micro-batches) runs training steps; its
    fastest step becomes the overhead per action that makes the empty plan's
    predicted step the measured one: the handing of micro-batches between
    worker threads, the autograd engine's wake-ups across them, and their
    turns at the interpreter lock.
    """
    import torch
    from torch import nn

    from pipe.pipe import Pipe

    kind, chunks = OVERHEAD_PLAN
    model = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=chunks, balance=[1, 1],
                 devices=["cpu", "cpu"], checkpoint="never", cpu_threads=1)
    x = torch.zeros(chunks, 4)
    try:
        step = _fastest(lambda: model(x).sum().backward(), steps=32, warm=4)
    finally:
        model.close()
    return _overhead(None, step, runner="threads")


def cached_thread_overhead(measure: bool = True) -> Optional[float]:
    """This machine's overhead per action of the thread runner from the cache (:func:`cache_path`, keyed as
    the link with "threads"); measured and stored first when missing and ``measure``, else None."""
    key = link_key("threads")
    stored = _cached()
    if key in stored:
        return float(stored[key]["action_overhead"])
    if not measure:
        return None
    overhead = measure_thread_overhead()
    _store(key, {"action_overhead": overhead})
    logger.info("measured the thread runner's overhead: %.3f ms per action", overhead * 1e3)
    return overhead


def measure_link(sizes: Sequence[int] = SIZES, repeats: int = 10, timeout: float = 120.0) -> Link:
    """Measures the gloo transport between two local processes (a few seconds).

    Raises:
        RuntimeError: a process failed or did not finish within ``timeout`` seconds.
    """
    from pipe.distributed.local_ranks import RankFailure, run_local_ranks

    try:  # fresh interpreters: the caller's script is not run again, and CUDA used here does not matter
        results = run_local_ranks(peer, 2, list(sizes), repeats, timeout=60.0, deadline=timeout,
                                  start_method="interpreter")
    except RankFailure as error:
        raise RuntimeError(f"measuring the transport between two local gloo processes failed or took more than "
                           f"{timeout} s; pass link=pipe.plan.Link(latency, per_byte) to plan instead:\n{error}"
                           ) from None
    best = {size: max(results[0][0][size], results[1][0][size]) for size in sizes}
    latency, per_byte = fit_line(best)
    link = Link(latency, per_byte, source=link_key())
    link = replace(link, action_overhead=_overhead(link, max(results[0][1], results[1][1])))
    sharded = {layers: max(results[0][2][layers], results[1][2][layers]) for layers in SHARDED_LAYERS}
    collective, per_step = _sharding_overheads(link, sharded)
    wide = max(results[0][4], results[1][4])
    per_byte_fsdp = _sharding_per_byte(link, sharded[SHARDED_LAYERS[0]], wide)
    reduce_latency, reduce_per_byte = fit_line({size: max(results[0][3][size], results[1][3][size])
                                             for size in REDUCE_SIZES})
    logger.info("measured the link: %.1f us per message + %.3f ns per byte; runner overhead %.3f ms per action; "
                "FSDP %.3f ms + %.3f ns per byte per collective step, %.3f ms per sharded stage and step; "
                "all-reduce %.1f us + %.3f ns per byte", latency * 1e6, per_byte * 1e9, link.action_overhead * 1e3,
                collective * 1e3, per_byte_fsdp * 1e9, per_step * 1e3, reduce_latency * 1e6, reduce_per_byte * 1e9)
    return replace(link, collective_overhead=collective, shard_step_overhead=per_step, reduce_latency=reduce_latency,
                   reduce_per_byte=reduce_per_byte, collective_per_byte=per_byte_fsdp)


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``seconds = a + b x bytes``, with ``a, b >= 0``."""
    n = len(points)
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_x, min(ys) if slope == 0 else 0.0), slope


def cached_link(measure: bool = True) -> Optional[Link]:
    """This machine's link figures from the cache; measured and stored first when missing and ``measure``."""
    key = link_key()
    stored = _cached()
    if key in stored and (not measure or "collective_per_byte" in stored[key]):  # else measured before it was
        entry = stored[key]
        return Link(float(entry["latency"]), float(entry["per_byte"]), source=f"{key} (cached {entry['when']})",
                    action_overhead=float(entry.get("action_overhead", 0.0)),
                    collective_overhead=float(entry.get("collective_overhead", 0.0)),
                    shard_step_overhead=float(entry.get("shard_step_overhead", 0.0)),
                    collective_per_byte=float(entry.get("collective_per_byte", 0.0)),
                    reduce_latency=float(entry.get("reduce_latency", 0.0)),
                    reduce_per_byte=float(entry.get("reduce_per_byte", 0.0)))
    if not measure:
        return None
    link = measure_link()
    _store(key, {"latency": link.latency, "per_byte": link.per_byte, "action_overhead": link.action_overhead,
                 "collective_overhead": link.collective_overhead, "shard_step_overhead": link.shard_step_overhead,
                 "reduce_latency": link.reduce_latency, "reduce_per_byte": link.reduce_per_byte,
                 "collective_per_byte": link.collective_per_byte})
    return link


def _cached() -> dict[str, Any]:
    """The cache's entries (none if it is missing or unreadable)."""
    try:
        return dict(json.loads(cache_path().read_text()))
    except (OSError, ValueError):
        return {}


def _store(key: str, entry: dict[str, Any]) -> None:
    """Adds ``entry`` (stamped with the time) under ``key`` to the cache, replacing the file whole."""
    path = cache_path()
    stored = _cached()
    stored[key] = {**entry, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(stored, indent=2))
        temporary.replace(path)
    except OSError as error:
        logger.warning("could not cache the measured figures in %s: %s", path, error)
