"""Stages and an order from measured layer costs: the cut, the placement and each rank's program together.

:func:`auto_schedule` times each layer's forward, input gradient and weight
gradient (:func:`pipe.balance.time_layers`, the balancer's and the planner's
one timing loop), cuts the layers into stages for each placement the ranks
allow (looped, one or two stages per rank; the V, two per rank), so that the
busiest rank is as light as possible (an expensive first or last stage, the
embedding or the head, gets fewer layers), and orders each cut with
:func:`pipe.core.cost_order.schedule_from_costs`. The fastest in simulation
wins. Usage::

    auto = pipe.balance.auto_schedule(model, sample, ranks=2, chunks=8)
    piped = DistributedPipe(model, chunks=8, schedule=auto.schedule, balance=auto.balance, loss_fn=...)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pipe.balance.solver import solve
from pipe.balance.timing import LayerTimes, time_layers
from pipe.balance.traced import TracedStep, calibrated_times
from pipe.core.cost_order import JudgedOrder, candidate_orders, fastest
from pipe.core.stage_costs import StageCosts, busy_bound
from pipe.core.microbatch import scatter
from pipe.core.options import CHECKPOINT_MODES, checkpoint_stop, positive_int
from pipe.core.partition import verify_module
from pipe.core.schedule_table import TableSchedule
from pipe.core.zero_bubble import v_rank_of

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoSchedule:
    """What :func:`auto_schedule` chose.

    Attributes:
        balance: layers per stage (``DistributedPipe``'s ``balance=``).
        schedule: each rank's order (``DistributedPipe``'s ``schedule=``), a :class:`TableSchedule`.
        step: the simulated step in seconds (compute, the runner's overhead per action, and messages: their
            bytes move once sent and their receive posted, where each rank posts it).
        costs: the per-stage costs it was ordered by.
        bound: the busiest rank's own work in seconds (:func:`pipe.core.stage_costs.busy_bound`): no order beats it.
        times: the layer times it cut and ordered by (scaled by ``measured=`` where given); pass them back as
            ``times=`` to order again without timing again.
        measured: the recorded step its costs were scaled to (``measured=``), or None.
    """

    balance: list[int]
    schedule: TableSchedule
    step: float
    costs: StageCosts
    bound: float
    times: LayerTimes
    measured: Optional[TracedStep] = None


def stage_costs(times: LayerTimes, rows: int, balance: Sequence[int], *, seconds_per_byte: float = 0.0,
                message_seconds: float = 0.0, action_seconds: float = 0.0, activation_bytes: bool = False
                ) -> StageCosts:
    """Each stage's F, I and W (its layers' sums) from per-layer times measured with ``split=True``.

    The first stage's input needs no gradient, so its I does nothing and its W the whole backward, as the
    runners run it. A message across a boundary costs ``message_seconds + seconds_per_byte * bytes`` of the
    activation sent there. With ``activation_bytes`` a cell weighs its layers' output bytes, else 1.

    Raises:
        ValueError: ``times`` has no I/W halves at ``rows`` (time with ``split=True``), or ``balance`` does not
            cover its layers.
    """
    if rows not in times.input_grad or rows not in times.weight_grad:
        raise ValueError(f"the layer times have no input/weight-gradient halves at {rows} rows; "
                         f"measure them with time_layers(..., split=True) on a micro-batch of {rows} rows")
    layers = len(times.forward[rows])
    if sum(balance) != layers or min(balance) < 1:
        raise ValueError(f"balance {list(balance)} does not cut {layers} layers into non-empty stages")
    bounds, start = [], 0
    for count in balance:
        bounds.append(range(start, start + count))
        start += count
    f = [math.fsum(times.forward[rows][k] for k in b) for b in bounds]
    i = [math.fsum(times.input_grad[rows][k] for k in b) for b in bounds]
    w = [math.fsum(times.weight_grad[rows][k] for k in b) for b in bounds]
    w[0], i[0] = w[0] + i[0], 0.0
    # A whole backward (B) as measured: run fused it is cheaper than its halves apart (W replays part of the graph).
    b = [math.fsum(times.backward[rows][k] for k in bound) for bound in bounds] if rows in times.backward else None
    sizes = times.output_bytes.get(rows, [0] * layers)
    transfer = [message_seconds + seconds_per_byte * sizes[b[-1]] for b in bounds[:-1]]
    activation = [float(max(1, sum(sizes[k] for k in b))) for b in bounds] if activation_bytes else 1.0
    return StageCosts.of(f, i, w, backward=b, transfer=transfer, activation=activation, overhead=action_seconds)


def _rank_loads(totals: Sequence[float], balance: Sequence[int], rank_of: Sequence[int], ranks: int
                ) -> tuple[float, float]:
    """(the busiest rank's cost, the costliest stage's) of a cut."""
    stage, start = [], 0
    for count in balance:
        stage.append(math.fsum(totals[start:start + count]))
        start += count
    return max(math.fsum(c for s, c in enumerate(stage) if rank_of[s] == r) for r in range(ranks)), max(stage)


def cut_for_ranks(totals: Sequence[float], stages: int, rank_of: Sequence[int], ranks: int) -> list[list[int]]:
    """Cuts of the layers (cost ``totals``) into ``stages``: the solver's (the costliest stage as cheap as
    possible), and that cut moved one boundary at a time while the busiest rank gets lighter (in the V the
    first and the last stage share rank 0)."""
    first = solve(totals, stages)
    cut, best = list(first), _rank_loads(totals, first, rank_of, ranks)
    improved = True
    while improved:
        improved = False
        for k in range(stages - 1):
            for step in (-1, 1):
                moved = list(cut)
                moved[k] += step
                moved[k + 1] -= step
                if min(moved) < 1:
                    continue
                load = _rank_loads(totals, moved, rank_of, ranks)
                if load < best:
                    cut, best, improved = moved, load, True
    return [first] if cut == first else [first, cut]


def auto_schedule(module: nn.Sequential, sample: Any = None, *, ranks: int, chunks: int, checkpoint: str = "never",
                  placement: str = "best", in_flight: Optional[float] = None, memory_limit: Optional[float] = None,
                  seconds_per_byte: float = 0.0, message_seconds: float = 0.0, action_seconds: Optional[float] = None,
                  timeout: float = 1.0, device: Optional[torch.device] = None, times: Optional[LayerTimes] = None,
                  measured: Optional[TracedStep] = None) -> AutoSchedule:
    """Stages and each rank's order from ``module``'s measured layer costs (see the module docstring).

    Args:
        module: the ``nn.Sequential`` to cut (left untouched: copies are timed).
        sample: a mini-batch; its first of ``chunks`` micro-batches is timed (not needed with ``times``).
        ranks, chunks: pipeline ranks and micro-batches per step.
        checkpoint: the ``DistributedPipe`` checkpoint mode it will run under (recomputes are costed).
        placement: ``"looped"``, ``"v"`` or ``"best"`` (see :func:`pipe.core.cost_order.schedule_from_costs`).
        in_flight: cells a rank may hold (default: 1F1B's peak); or ``memory_limit``, bytes of activations
            a rank may hold (a cell weighs its layers' output bytes).
        seconds_per_byte, message_seconds: the cost of a message between ranks (default: free).
        action_seconds: what the runner adds to each action (default: ``measured.overhead``, else nothing);
            a few tens of microseconds on the CPU, which matters where layers are small.
        timeout: seconds to keep timing the layers (more rounds, less noise).
        device: where to time them (default: the CPU).
        times: layer times measured before (``time_layers(..., split=True)`` on one micro-batch, or an
            earlier result's ``times``): skips timing.
        measured: a recorded step of this model under the runner (:func:`pipe.balance.traced_step`): each
            stage's layers are scaled to its medians before cutting and ordering, so that the simulated step
            is the runner's (see :mod:`pipe.balance.traced`).

    Returns:
        An :class:`AutoSchedule`: ``balance`` and ``schedule`` for ``DistributedPipe``, and the simulated step.

    Raises:
        ValueError: a bad argument, or a memory limit no order fits (the message says the least that does).
    """
    verify_module(module)
    positive_int("ranks", ranks, "pipeline ranks")
    positive_int("chunks", chunks, "micro-batches per step")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if len(module) < ranks:
        raise ValueError(f"cannot cut {len(module)} layers into stages for {ranks} ranks; use at most "
                         f"{len(module)} ranks")
    if times is None:
        if sample is None:
            raise ValueError("auto_schedule needs sample= (a mini-batch) to time the layers, or times=")
        micro = scatter(sample, chunks)[0]
        times = time_layers(module, {0: micro.value}, device or torch.device("cpu"), rounds=3, timeout=timeout,
                            split=True, window=-(-len(module) // ranks))
    rows = next(iter(times.forward))
    if rows not in times.input_grad or len(times.forward[rows]) != len(module):
        raise ValueError(f"times must hold the {len(module)} layers' I and W halves: time_layers(..., split=True)")
    if measured is not None:
        times = calibrated_times(times, rows, measured)
        action_seconds = measured.overhead if action_seconds is None else action_seconds
    action_seconds = action_seconds or 0.0
    totals = [f + i + w + (f if checkpoint != "never" else 0.0) for f, i, w in
              zip(times.forward[rows], times.input_grad[rows], times.weight_grad[rows])]
    options = [("looped", ranks)] * (placement in ("looped", "best"))
    if len(module) >= 2 * ranks:
        options += [("v", 2 * ranks)] * (placement in ("v", "best"))
        options += [("looped", 2 * ranks)] * (placement in ("looped", "best") and ranks > 1)
    if not options:
        raise ValueError(f"placement={placement!r} needs {2 * ranks} layers or more for {ranks} ranks "
                         f"(2 stages per rank); the model has {len(module)}: use placement='looped'")
    best: Optional[tuple[JudgedOrder, list[int], StageCosts]] = None
    for where, stages in options:
        rank_of = [v_rank_of(s, ranks) if where == "v" else s % ranks for s in range(stages)]
        for balance in cut_for_ranks(totals, stages, rank_of, ranks):
            costs = stage_costs(times, rows, balance, seconds_per_byte=seconds_per_byte,
                                message_seconds=message_seconds, action_seconds=action_seconds,
                                activation_bytes=memory_limit is not None)
            found = [c for c in candidate_orders(costs, ranks=ranks, microbatches=chunks, placement=where,
                                                 in_flight=in_flight, memory_limit=memory_limit,
                                                 checkpoint=checkpoint) if c.fits]
            if found:
                candidate = fastest(found, costs, checkpoint)
                if best is None or candidate.step < best[0].step - 1e-12:
                    best = (candidate, balance, costs)
    if best is None:
        raise ValueError(f"no order of {len(module)} layers on {ranks} ranks fits in_flight={in_flight!r} / "
                         f"memory_limit={memory_limit!r}; raise it (one micro-batch of a rank's layers at least)")
    candidate, balance, costs = best
    logger.info("auto schedule: %s, balance %s, simulated step %.4g s", candidate.name, balance, candidate.step)
    return AutoSchedule(balance, candidate.schedule, candidate.step, costs,
                        busy_bound(costs, candidate.schedule.placement, chunks, checkpoint_stop(checkpoint, chunks)),
                        times, measured)
