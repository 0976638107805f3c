"""The planner without a memory budget: the cut and each rank's order from a model's measured layer costs.

:func:`auto_schedule` times each layer's forward, input gradient, weight
gradient and whole backward on one micro-batch (:func:`pipe.balance.time_layers`,
the balancer's and the planner's one timing loop) and hands them to the
planner's search (:func:`pipe.plan.search`) with no budget and the orders
built from the costs only (``"auto"``: one or two stages per rank, looped;
``"auto-v"``: two per rank in a V; :func:`pipe.schedule_from_costs`). The
search weighs every cut it considers (an expensive first or last stage, the
embedding or the head, gets fewer layers) and simulates the lowered programs
of the fastest; the fastest wins. Usage::

    auto = pipe.plan.auto_schedule(model, sample, ranks=2, chunks=8)
    piped = DistributedPipe(model, chunks=8, schedule=auto.schedule, balance=auto.balance, loss_fn=...)

With a memory budget, and the fixed schedules, recompute and sharding weighed
too, the same search is :func:`pipe.plan.plan`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from pipe.balance.timing import LayerTimes, time_layers
from pipe.balance.traced import TracedStep
from pipe.core.microbatch import scatter
from pipe.core.options import CHECKPOINT_MODES, positive_int
from pipe.core.partition import verify_module
from pipe.core.schedule_table import TableSchedule
from pipe.core.stage_costs import StageCosts
from pipe.plan.candidate import AUTO, AUTO_V, Candidate
from pipe.plan.cost import Costs
from pipe.plan.predict import busy_bound, stage_costs
from pipe.plan.search import search
from pipe.plan.timing import Link, TimeModel, fit

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The planner's schedule kinds for each ``placement=``.
PLACEMENTS = {"looped": (AUTO,), "v": (AUTO_V,), "best": (AUTO, AUTO_V)}


@dataclass(frozen=True)
class AutoSchedule:
    """What :func:`auto_schedule` chose.

    Attributes:
        balance: layers per stage (``DistributedPipe``'s ``balance=``).
        schedule: each rank's order (``DistributedPipe``'s ``schedule=``), a :class:`TableSchedule`.
        step: the simulated step in seconds (the lowered programs: compute, the runner's overhead per action,
            and messages, whose bytes move once sent and their receive posted).
        costs: the per-stage costs it was ordered by.
        bound: the busiest rank's own work in seconds (:func:`pipe.core.stage_costs.busy_bound`): no order beats it.
        times: the layer times it cut and ordered by, as timed; pass them back as ``times=`` to order again
            without timing again.
        measured: the recorded steps its time model was read off (``measured=``), or none.
        model: the time model it simulated with (:class:`pipe.plan.TimeModel`; read off ``measured`` where given).
    """

    balance: list[int]
    schedule: TableSchedule
    step: float
    costs: StageCosts
    bound: float
    times: LayerTimes
    measured: tuple[TracedStep, ...] = ()
    model: TimeModel = TimeModel()


def auto_schedule(module: nn.Sequential, sample: Any = None, *, ranks: int, chunks: int, checkpoint: str = "never",
                  placement: str = "best", seconds_per_byte: float = 0.0, message_seconds: float = 0.0,
                  action_seconds: Optional[float] = None, timeout: float = 1.0, device: Optional[torch.device] = None,
                  times: Optional[LayerTimes] = None,
                  measured: Union[TracedStep, Sequence[TracedStep], None] = None) -> AutoSchedule:
    """Stages and each rank's order from ``module``'s measured layer costs (see the module docstring).

    Args:
        module: the ``nn.Sequential`` to cut (left untouched: copies are timed).
        sample: a mini-batch; its first of ``chunks`` micro-batches is timed (not needed with ``times``).
        ranks, chunks: pipeline ranks and micro-batches per step.
        checkpoint: the ``DistributedPipe`` checkpoint mode it will run under (recomputes are costed).
        placement: ``"looped"`` (stage s on rank s % ranks, one or two stages per rank), ``"v"`` (two per
            rank, in a V) or ``"best"`` (both).
        seconds_per_byte, message_seconds: the cost of a message between ranks (default: free).
        action_seconds: what the runner adds to each action (default: read off ``measured``, else nothing);
            a few tens of microseconds on the CPU, which matters where layers are small.
        timeout: seconds to keep timing the layers (more rounds, less noise).
        device: where to time them (default: the CPU).
        times: layer times measured before (``time_layers(..., split=True)`` on one micro-batch, or an
            earlier result's ``times``): skips timing.
        measured: recorded steps of this model under the runner, with these ``chunks`` and ``checkpoint``
            (:func:`pipe.balance.traced_step`, one or a list): the time model is read off them
            (:func:`pipe.plan.fit` with ``traced=``: each phase's compute over the layer times', the runner's
            time per action), so that the simulated step is the runner's, for any cut. A cut recorded more
            than once counts with its last step.

    Returns:
        An :class:`AutoSchedule`: ``balance`` and ``schedule`` for ``DistributedPipe``, and the simulated step.

    Raises:
        ValueError: a bad argument (the message says which and the fix).
    """
    verify_module(module)
    positive_int("ranks", ranks, "pipeline ranks")
    positive_int("chunks", chunks, "micro-batches per step")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, got {placement!r}")
    if len(module) < ranks:
        raise ValueError(f"cannot cut {len(module)} layers into stages for {ranks} ranks; use at most "
                         f"{len(module)} ranks")
    if placement == "v" and len(module) < 2 * ranks:
        raise ValueError(f"placement='v' needs {2 * ranks} layers or more for {ranks} ranks (2 stages per rank); "
                         f"the model has {len(module)}: use placement='looped'")
    if times is None:
        if sample is None:
            raise ValueError("auto_schedule needs sample= (a mini-batch) to time the layers, or times=")
        micro = scatter(sample, chunks)[0]
        rows = micro.tensors[0].size(0) if micro.tensors else 1  # the key of the times: the micro-batch's rows
        times = time_layers(module, {rows: micro.value}, device or torch.device("cpu"), rounds=3, timeout=timeout,
                            split=True, window=-(-len(module) // ranks))
    rows = next(iter(times.forward))
    if rows not in times.input_grad or len(times.forward[rows]) != len(module):
        raise ValueError(f"times must hold the {len(module)} layers' I and W halves: time_layers(..., split=True)")
    steps = (measured,) if isinstance(measured, TracedStep) else tuple(measured or ())
    link = Link(message_seconds, seconds_per_byte) if message_seconds or seconds_per_byte else None
    costs = Costs.from_layer_times(times, chunks)
    model = TimeModel(link=link)
    if steps:
        wrong = [list(step.balance) for step in steps if sum(step.balance) != len(module) or len(step.balance) % ranks]
        if wrong:
            raise ValueError(f"measured steps ran balances {wrong}, which do not cut the {len(module)} layers into "
                             f"stages for {ranks} ranks: record this model on these ranks")
        recorded = {Candidate(AUTO, chunks, tuple(step.balance), checkpoint, len(step.balance) // ranks): step
                    for step in steps}
        model = fit(costs, {}, traced=recorded, link=link)
    if action_seconds is not None or not steps:
        model = replace(model, action_overhead=action_seconds or 0.0)
    plan = search(costs, ranks, runner="processes", schedules=PLACEMENTS[placement], checkpoints=(checkpoint,),
                  model=model, per_stage=False, runners_up=0, rejected=0)
    best = plan.best
    assert isinstance(best.schedule, TableSchedule)  # an "auto" candidate's order, built from its costs
    logger.info("auto schedule: %s, balance %s, simulated step %.4g s", best.schedule.name,
                list(best.candidate.balance), best.step_time)
    return AutoSchedule(list(best.candidate.balance), best.schedule, best.step_time,
                        stage_costs(costs, best.candidate, model), busy_bound(costs, best.candidate, model), times,
                        steps, model)
