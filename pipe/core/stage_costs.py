"""The time model of a cut: what each stage's actions and messages cost, and the step a schedule takes under it.

:class:`StageCosts` holds, per stage and micro-batch, the seconds of each
action (F, I, W, B and R, a recompute), of the message across each boundary
(an activation forward, its gradient back) and the runner's own time per
action. Every part of pipe that times a schedule times it with these numbers
and one simulator (:func:`pipe.core.program_time.time_schedule`):

* the cost-shaped orders (:mod:`pipe.core.cost_order`) are built and judged with them;
* the planner (:func:`pipe.plan.predict`) derives them from a model's layer times and a
  candidate's cut and recompute marks (:meth:`pipe.plan.Costs.stage_costs`), and adds what
  its time model knows besides: contention, cores shared, messages and FSDP's collectives;
* a traced step (:meth:`pipe.balance.TracedStep.costs`) gives the costs that ran.

:func:`busy_bound` is the step no order can beat under them, used to skip
candidates without simulating. The module imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from pipe.core.action import Action, Phase
from pipe.core.program_time import makespan
from pipe.core.schedule import Schedule

__all__: list[str] = []

Number = Union[int, float]


def _numbers(name: str, values: Union[Number, Sequence[Number]], count: int, positive: bool = False) -> tuple[float, ...]:
    """``values`` (one number, or ``count`` numbers) as floats, checked finite and >= 0 (> 0 if ``positive``)."""
    listed: list[Any] = [values] * count if isinstance(values, (int, float)) else list(values)
    if len(listed) != count:
        boundary = " boundary" if name in ("transfer", "gradient") else ""
        raise ValueError(f"{name} needs {count} entries (one per stage{boundary}), got {len(listed)}: {listed!r}")
    for k, value in enumerate(listed):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (positive and value == 0):
            raise ValueError(f"{name}[{k}] = {value!r}: costs must be finite numbers "
                             f"{'> 0' if positive else '>= 0'} (seconds, or any one unit)")
    return tuple(float(v) for v in listed)


@dataclass(frozen=True)
class StageCosts:
    """What each stage's actions cost, for one micro-batch; build it with :meth:`of` (which checks it).

    Attributes:
        forward, input_grad, weight_grad: seconds of F, I and W of each stage.
        backward: seconds of a whole backward (B) of each stage; ``I + W`` unless measured.
        transfer: seconds of the message (an activation forward) across each of the ``stages - 1``
            boundaries between stages on different ranks.
        activation: what a cell of each stage holds from its F to its W (bytes, or 1 per cell).
        overhead: seconds the runner adds to every F, I, W or B action (dispatch, message headers): a
            split backward pays it twice, a B once.
        recompute: seconds of a recompute (R) of each stage, its forward again before its backward
            in a checkpointed cell; the forward unless measured (the checkpoint's own work added).
        gradient: seconds of the gradient message back across each boundary; ``transfer`` unless
            measured apart (a stage's output may hold tensors that need no gradient).
    """

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: tuple[float, ...]
    activation: tuple[float, ...]
    overhead: float = 0.0
    recompute: tuple[float, ...] = ()
    gradient: tuple[float, ...] = ()

    def __post_init__(self) -> None:  # the defaults of the two that follow others
        if not self.recompute:
            object.__setattr__(self, "recompute", self.forward)
        if not self.gradient:
            object.__setattr__(self, "gradient", self.transfer)

    @classmethod
    def of(cls, forward: Sequence[Number], input_grad: Sequence[Number], weight_grad: Sequence[Number], *,
           backward: Optional[Sequence[Number]] = None, transfer: Union[Number, Sequence[Number]] = 0.0,
           activation: Union[Number, Sequence[Number]] = 1.0, overhead: Number = 0.0,
           recompute: Optional[Sequence[Number]] = None,
           gradient: Optional[Union[Number, Sequence[Number]]] = None) -> "StageCosts":
        """The costs of ``len(forward)`` stages, checked.

        Raises:
            ValueError: a list of the wrong length, or a cost that is not a finite number >= 0.
        """
        if isinstance(forward, (int, float)) or not len(forward):
            raise ValueError(f"forward needs one cost per stage (a non-empty list), got {forward!r}")
        n = len(forward)
        f = _numbers("forward", forward, n)
        i, w = _numbers("input_grad", input_grad, n), _numbers("weight_grad", weight_grad, n)
        b = _numbers("backward", backward, n) if backward is not None else tuple(x + y for x, y in zip(i, w))
        for k in range(n):
            if f[k] + i[k] + w[k] <= 0:
                raise ValueError(f"stage {k} costs nothing (F, I and W all 0); give it its measured times")
        sent = _numbers("transfer", transfer, n - 1)
        return cls(f, i, w, b, sent, _numbers("activation", activation, n, True), _numbers("overhead", overhead, 1)[0],
                   _numbers("recompute", recompute, n) if recompute is not None else f,
                   _numbers("gradient", gradient, n - 1) if gradient is not None else sent)

    @property
    def stages(self) -> int:
        return len(self.forward)

    def cost(self, phase: Union[Phase, str], stage: int, contention: float = 1.0) -> float:
        """Seconds of ``phase`` (F, I, W, B, or R; a :class:`Phase` or its letter) on ``stage``: its compute
        times ``contention`` (compute slowed by ranks sharing cores), and the runner's overhead (not on R,
        which runs inside the backward's action)."""
        phase = phase if isinstance(phase, Phase) else Phase(phase)
        seconds: tuple[float, ...] = getattr(self, _FIELD[phase])
        return seconds[stage] * contention + (self.overhead if phase is not Phase.RECOMPUTE else 0.0)


_FIELD = {Phase.FORWARD: "forward", Phase.RECOMPUTE: "recompute", Phase.INPUT: "input_grad",
          Phase.WEIGHT: "weight_grad", Phase.BACKWARD: "backward"}


def action_costs(schedule: Schedule, costs: StageCosts) -> tuple[Callable[[Action], float], Callable[[Action], float]]:
    """``(duration, transfer)`` of an action under ``costs``, for :func:`pipe.core.program_time.time_schedule`:
    its own seconds (:meth:`StageCosts.cost`) and those of the message it waits for (:func:`message_cost`)."""
    return (lambda action: costs.cost(action.phase, action.stage)), message_cost(schedule, costs)


def message_cost(schedule: Schedule, costs: StageCosts) -> Callable[[Action], float]:
    """Seconds of the message an action waits for under ``costs``: its boundary's transfer (F) or gradient
    (I, B) where the neighbouring stage runs on another rank; nothing for W and R."""
    last = schedule.stages - 1

    def transfer(action: Action) -> float:
        s, here = action.stage, schedule.rank_of(action.stage)
        if action.phase is Phase.FORWARD:
            return costs.transfer[s - 1] if s > 0 and schedule.rank_of(s - 1) != here else 0.0
        if action.phase in (Phase.INPUT, Phase.BACKWARD):
            return costs.gradient[s] if s < last and schedule.rank_of(s + 1) != here else 0.0
        return 0.0

    return transfer


def lowered_step(schedule: Schedule, costs: StageCosts, stop: int = 0) -> float:
    """The step of ``schedule``'s lowered programs (:func:`pipe.core.program_time.time_schedule`) under
    ``costs``, micro-batches ``i < stop`` recomputed: receives posted where each rank posts them, a message's
    bytes moving once both its send and its receive are posted."""
    return makespan(schedule, *action_costs(schedule, costs), stop)


def busy_bound(costs: StageCosts, rank_of: Sequence[int], microbatches: int, stop: int = 0, *,
               splits: Optional[bool] = None, contention: float = 1.0,
               besides: Optional[Sequence[float]] = None) -> float:
    """A lower bound of the step under ``costs``, without simulating: the busiest rank's own work.

    For each rank (``rank_of[s]``: the rank of stage s): its actions' seconds with no wait (F, the backward
    as the schedule runs it, R of micro-batches ``i < stop``; ``splits`` True: I + W, False: B, None:
    whichever is cheaper), ``besides[rank]`` seconds more (collectives), and the forwards of one micro-batch
    on the stages before its first (it cannot start earlier); where the backward is one B (``splits`` False),
    the backwards of one micro-batch on those stages too (its last backward is followed by theirs). Compute
    is scaled by ``contention``, as in :meth:`StageCosts.cost`.
    """
    m, redo = microbatches, min(stop, microbatches)

    def back(s: int) -> float:
        b = costs.cost(Phase.BACKWARD, s, contention)
        iw = costs.cost(Phase.INPUT, s, contention) + costs.cost(Phase.WEIGHT, s, contention)
        return iw if splits else b if splits is False else min(b, iw)

    busiest = 0.0
    for rank in sorted(set(rank_of)):
        mine = [s for s in range(costs.stages) if rank_of[s] == rank]
        total = besides[rank] if besides is not None else 0.0
        for s in mine:
            total += m * (costs.cost(Phase.FORWARD, s, contention) + back(s)) \
                + redo * costs.cost(Phase.RECOMPUTE, s, contention)
        before = range(min(mine))
        total += math.fsum(costs.forward[s] for s in before) * contention
        if splits is False:
            total += math.fsum(costs.backward[s] for s in before) * contention
        busiest = max(busiest, total)
    return busiest
