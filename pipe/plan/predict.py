"""Prediction: a candidate plan's step time and each rank's peak memory, from costs.

Time comes from simulating the ranks' lowered programs (:mod:`pipe.core.lowering`,
the steps the process runner executes; :func:`pipe.core.program_time.simulate`)
with each action's measured duration and each message's transfer, not from a
formula, so a prediction follows the same order of steps that the runners
execute. Memory follows the
same programs (:meth:`Schedule.actions`): walking a rank's program, a forward
adds its micro-batch's kept bytes (checkpointed or not, by ``checkpoint_stop``),
a backward frees them; the peak is the largest of "held + this forward's
high-water mark" and "held + this backward's high-water mark"::

    rank 1, GPipe, M=3:  F0 F1 F2 B2 B1 B0
    held (kept bytes):   k  2k 3k 2k k  0     peak = 2k + forward_peak, or 3k + backward_peak
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pipe.core.options import checkpoint_stop
from pipe.core.program_time import makespan, time_schedule
from pipe.core.stage_costs import StageCosts, message_cost
from pipe.core.stage_costs import busy_bound as stage_busy_bound
from pipe.core.action import Action, Phase, TimedAction
from pipe.core.schedule import Schedule
from pipe.core.message import HEADER_BYTES, sent_copy_bytes
from pipe.core.zero_bubble import ZERO_BUBBLE_KINDS
from pipe.core.cost_order import schedule_from_costs
from pipe.plan.candidate import AUTO_KINDS, AUTO_V, Candidate
from pipe.plan.cost import Costs
from pipe.plan.sharding import (Held, backward_peak_with_shards, collective_seconds, held_by_averager, held_by_fsdp,
                                replica_costs, sharded_static)
from pipe.plan.timing import SHARING_ROUNDS, TimeModel, shared_stretch

LOSS_SCALAR_BYTES = 2 * 4
"""What the process runner's step keeps of the loss on the last stage: two float32 scalars (measured; its
running sum and the latest micro-batch's loss, which goes with the last cell's backward (W in a zero-bubble
schedule): the sum alone is kept after it. Before the lowered programs, the loop's scaled copy of the
latest loss stayed alive one action longer: a third)."""

__all__: list[str] = []


@dataclass
class Prediction:
    """What a candidate is predicted to cost.

    Attributes:
        step_time: seconds of one training step (the simulated makespan).
        peaks: bytes per rank at its high-water mark (static + activations).
        static: bytes per rank of parameters, gradients and optimiser state.
        timeline: the simulated timed actions (seconds).
        schedule: the schedule timed; for ``"auto"`` the order built from the candidate's costs, which
            ``DistributedPipe(schedule=...)`` runs (:meth:`pipe.plan.Plan.distributed_kwargs` passes it).
    """

    candidate: Candidate
    step_time: float
    peaks: list[int]
    static: list[int]
    timeline: list[TimedAction] = field(repr=False, default_factory=list)
    schedule: Optional[Schedule] = field(repr=False, default=None)

    @property
    def peak(self) -> int:
        return max(self.peaks)

    def idle(self) -> list[float]:
        """Seconds each rank spends without compute in the simulated step."""
        busy = [0.0] * len(self.peaks)
        for timed in self.timeline:
            busy[timed.rank] += timed.duration
        return [self.step_time - b for b in busy]


def _bounds(balance: tuple[int, ...]) -> list[tuple[int, int]]:
    bounds, first = [], 0
    for size in balance:
        bounds.append((first, first + size))
        first += size
    return bounds


def predict(costs: Costs, candidate: Candidate, *, runner: str = "threads", timeline: bool = True,
            model: Optional[TimeModel] = None, memory: Optional[tuple[list[int], list[int]]] = None) -> Prediction:
    """Step time and per-rank peak bytes of ``candidate``, from ``costs`` and the time ``model``
    (:class:`pipe.plan.timing.TimeModel`; default: layer times alone, messages free).

    Raises:
        ValueError: the candidate does not fit the model (its balance does not
            cover the layers, or a schedule argument is out of range).
    """
    model = model or TimeModel()
    peaks_static = memory or predict_memory(costs, candidate, runner=runner, model=model)
    costs = replica_costs(costs, candidate.parts)
    schedule = _schedule(costs, candidate, model)
    bounds = _bounds(candidate.balance)
    stop = checkpoint_stop(candidate.checkpoint, candidate.chunks)
    times = stage_costs(costs, candidate, model)
    scale = model.contention
    collectives: dict[Action, float] = {}
    for rank in range(schedule.ranks):  # FSDP's or the averager's collectives, on the actions that issue them
        collectives.update(collective_seconds(costs, schedule, rank, bounds, candidate, model.link))

    def messages(action: Action) -> int:  # sent and received to and from other ranks
        if action.phase not in (Phase.FORWARD, Phase.BACKWARD, Phase.INPUT):
            return 0
        here = schedule.rank_of(action.stage)
        return _remote(schedule, action.stage - 1, here) + _remote(schedule, action.stage + 1, here)

    stretch: dict[Action, float] = {}  # compute slowed by the ranks sharing cores (model.cores)

    def duration(action: Action) -> float:
        seconds = times.cost(action.phase, action.stage, scale * stretch.get(action, 1.0))
        if action.phase is Phase.RECOMPUTE:
            return seconds
        return seconds + model.message_overhead * messages(action) + collectives.get(action, 0.0)

    transfer = message_cost(schedule, times)
    peaks, static = peaks_static
    cores = model.cores / candidate.parts if model.cores is not None else None  # this pipeline's share
    if not timeline and (cores is None or cores >= schedule.ranks):  # the step alone, no timed actions built
        return Prediction(candidate, makespan(schedule, duration, transfer, stop), peaks, static, [], schedule)
    simulated = time_schedule(schedule, duration, transfer, stop)
    if cores is not None and cores < schedule.ranks:
        for _ in range(SHARING_ROUNDS):
            stretch = shared_stretch(simulated, cores)
            simulated = time_schedule(schedule, duration, transfer, stop)
    step_time = max(t.end for t in simulated)
    return Prediction(candidate, step_time, peaks, static, simulated if timeline else [], schedule)


def _remote(schedule: Schedule, stage: int, rank: int) -> bool:
    """Whether ``stage`` exists and runs on another rank than ``rank``: a neighbour reached by a message."""
    return 0 <= stage < schedule.stages and schedule.rank_of(stage) != rank


def _schedule(costs: Costs, candidate: Candidate, model: Optional[TimeModel] = None) -> Schedule:
    """The schedule ``candidate`` runs (``costs`` a pipeline's share: :func:`pipe.plan.sharding.replica_costs`),
    checked against the costs: for ``"auto"`` the order built from its stage costs under ``model``, else its
    kind's. With ``model=None``, only where each stage runs (:meth:`Candidate.layout`)."""
    schedule = candidate.layout()
    if sum(candidate.balance) != costs.layers or min(candidate.balance) < 1:
        raise ValueError(f"balance {list(candidate.balance)} does not split {costs.layers} layers into non-empty "
                         f"stages; its entries must be >= 1 and sum to {costs.layers}")
    for name, counts in (("recompute", candidate.recompute), ("select", candidate.select),
                         ("offload", candidate.offload)):
        if counts and (len(counts) != len(candidate.balance)
                       or any(not 0 <= c <= n for c, n in zip(counts, candidate.balance))):
            raise ValueError(f"{name}={list(counts)} needs one count per stage ({len(candidate.balance)}), "
                             f"each between 0 and the stage's layers {list(candidate.balance)}")
    if any(candidate.offload):
        if candidate.checkpoint != "never" or any(candidate.recompute) or candidate.selective():
            raise ValueError(f"offload={list(candidate.offload)} is planned with checkpoint='never' and no recompute "
                             f"marks (got checkpoint={candidate.checkpoint!r}, recompute={list(candidate.recompute)}, "
                             f"select={list(candidate.select)}): a layer either offloads or recomputes")
        if candidate.schedule in (*ZERO_BUBBLE_KINDS, *AUTO_KINDS):
            which = "the zero-bubble schedule" if candidate.schedule in ZERO_BUBBLE_KINDS else \
                "the order built from the costs"
            raise ValueError(f"offload={list(candidate.offload)} is not planned with {which} "
                             f"{candidate.schedule!r}; plan it with 'gpipe', '1f1b' or 'interleaved'")
        if not costs.offloads:
            raise ValueError(f"offload={list(candidate.offload)} needs costs that measured offload (the bytes each "
                             f"layer moves and the device's host copy): profile on a CUDA device")
    if candidate.selective() and not candidate.select_names:
        raise ValueError(f"select={list(candidate.select)} needs select_names, the name regexes to mark with "
                         f"(the profile's Costs.select)")
    if candidate.schedule not in AUTO_KINDS or model is None:
        return schedule
    if candidate.schedule == AUTO_V and candidate.virtual_stages != 2 or candidate.virtual_stages > 2:
        raise ValueError(f"schedule={candidate.schedule!r} is planned with {'two stages' if candidate.schedule == AUTO_V else 'one or two stages'} "
                         f"per rank, got virtual_stages={candidate.virtual_stages}")
    key = (candidate, model)
    if key not in costs._orders:  # the same costs, cut, marks and model always give the same order
        costs._orders[key] = schedule_from_costs(stage_costs(costs, candidate, model), ranks=candidate.ranks,
                                                 microbatches=candidate.chunks,
                                                 placement="v" if candidate.schedule == AUTO_V else "looped",
                                                 checkpoint=candidate.checkpoint)
    return costs._orders[key]


def predict_memory(costs: Costs, candidate: Candidate, *, runner: str = "threads",
                   ranks: Optional[list[int]] = None, model: Optional[TimeModel] = None) -> tuple[list[int], list[int]]:
    """``(peaks, static)``: bytes per rank at its high-water mark, and of its parameters, gradients and
    optimiser state; only ``ranks`` (the others get 0) when given. A sharded candidate (``dp_shard > 1``)
    holds shards of the static bytes, and FSDP's unsharded parameters and gradients during the step
    (:func:`pipe.plan.sharding.held_by_fsdp`); a replicated one (``dp_replicate > 1``, unsharded) the
    averager's flat gradient copies (:func:`pipe.plan.sharding.held_by_averager`). ``model``: the time
    model an ``"auto"`` order is built under (default: layer times alone)."""
    costs = replica_costs(costs, candidate.parts)
    schedule = _schedule(costs, candidate, model or TimeModel())
    bounds = _bounds(candidate.balance)
    stop = checkpoint_stop(candidate.checkpoint, candidate.chunks)
    peaks, static = [], []
    for rank in range(schedule.ranks):
        if ranks is not None and rank not in ranks:
            peaks.append(0)
            static.append(0)
            continue
        extra: Optional[Held] = None
        if candidate.dp_shard > 1:
            fixed = sharded_static(costs, bounds, schedule.stages_of(rank), candidate.dp_shard)
            extra = held_by_fsdp(costs, schedule, rank, bounds, candidate.dp_shard, candidate.reshard_after_forward,
                                 candidate.blocks, candidate.dp_replicate)
        else:
            layers = [k for s in schedule.stages_of(rank) for k in range(*bounds[s])]
            fixed = int(costs.param_scale * costs.params_of(layers))  # a weight tied between its stages once
            if candidate.dp_replicate > 1:
                extra = held_by_averager(costs, schedule, rank, bounds)
        peaks.append(fixed + _activation_peak(costs, schedule, rank, bounds, stop, runner, candidate, extra))
        static.append(fixed)
    return peaks, static


def stage_costs(costs: Costs, candidate: Candidate, model: TimeModel) -> StageCosts:
    """The :class:`~pipe.core.stage_costs.StageCosts` of ``candidate``'s cut and marks (``costs`` already a
    pipeline's share of the batch: :func:`pipe.plan.sharding.replica_costs`): messages over ``model``'s link,
    its overhead per action, each phase's layer times scaled by ``model.phases``."""
    n = len(candidate.balance)
    return costs.stage_costs(_bounds(candidate.balance), candidate.chunks,
                             [candidate.recomputed(s) for s in range(n)], [candidate.selected(s) for s in range(n)],
                             [candidate.offloaded(s) for s in range(n)],
                             message=model.link.cost if model.link is not None else None,
                             overhead=model.action_overhead, phases=model.phases)


def busy_bound(costs: Costs, candidate: Candidate, model: Optional[TimeModel] = None) -> float:
    """A lower bound of the predicted step time, without simulating: :func:`pipe.core.stage_costs.busy_bound`
    of the candidate's stage costs, its compute slowed by ``model.contention``, each rank's collectives
    added. :func:`pipe.plan.search.search` visits candidates in the order of this bound and stops once it
    exceeds the plans already found, so most candidates are never simulated.
    """
    model = model or TimeModel()
    costs = replica_costs(costs, candidate.parts)
    schedule = _schedule(costs, candidate)
    bounds = _bounds(candidate.balance)
    auto = candidate.schedule in AUTO_KINDS  # its order, and so its backward and its collectives, not built yet
    collectives = None if auto else [
        math.fsum(collective_seconds(costs, schedule, rank, bounds, candidate, model.link).values())
        for rank in range(schedule.ranks)]
    return stage_busy_bound(stage_costs(costs, candidate, model), [schedule.rank_of(s) for s in range(schedule.stages)],
                            candidate.chunks, checkpoint_stop(candidate.checkpoint, candidate.chunks),
                            splits=None if auto else schedule.splits_backward, contention=model.contention,
                            besides=collectives)


def _activation_peak(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]],
                     stop: int, runner: str = "threads", candidate: Optional[Candidate] = None,
                     besides: Optional[Held] = None) -> int:
    """The high-water mark of activation bytes along ``rank``'s program.

    With ``runner="processes"`` the process runner's buffers count too
    (:mod:`pipe.distributed.runtime`): the receive of the next action is
    posted (its buffer allocated) before this action runs, and a sent tensor
    (an activation, or an input gradient) stays referenced by its pending
    send until the step's end at the latest; each message has a header of
    ``HEADER_BYTES``, and a small value (``INLINE_BYTES``) is copied behind it
    (then the send holds that copy instead). In the zero-bubble schedules, I keeps the graph and
    what it recorded for W (:attr:`StageMemory.after_input`, counted) and
    sends the input gradient; W adds its own high-water mark
    (:attr:`StageMemory.weight_peak`), then frees them. ``besides``: bytes held besides
    activations during each action (FSDP's unsharded parameters and gradients, the averager's copies), and
    the backwards that create a stage's gradients (counted with ``fresh``), and the bytes held after the
    actions whose stage's gradients the averager copies (``besides.copied``). An offloading stage keeps
    only what its offloader leaves on the device; the process runner copies a cell's units back as the
    action before its backward starts (:attr:`StageMemory.fetched`), or, made by that very action, as
    its backward uses them; the thread runner one unit ahead of use.
    """
    held = peak = 0
    kept: dict[tuple[int, int], int] = {}
    program = schedule.actions(rank)
    rows = costs.rows(schedule.microbatches)
    sizes = costs.output_bytes.get(rows, [])
    grads = costs.grad_bytes.get(rows, [])  # a gradient message holds the tensors that need one
    last_stage = schedule.stages - 1

    def remote(stage: int) -> bool:  # a neighbour on another rank: a message (on this rank, the tensor itself)
        return _remote(schedule, stage, rank)

    def incoming(action: Action) -> int:  # bytes of the message an action waits for, with its header
        first, stop_ = bounds[action.stage]
        if action.phase is Phase.WEIGHT:  # W waits for nothing: no receive is posted for it
            return 0
        if action.phase is Phase.FORWARD:
            return HEADER_BYTES + sizes[first - 1] if remote(action.stage - 1) and sizes else 0
        return HEADER_BYTES + grads[stop_ - 1] if remote(action.stage + 1) and sizes else 0

    sent = 0
    scalars = 0  # the step's loss scalars on the last stage (its running sum, the latest loss)
    # The action with which the last stage's last cell goes (its W in a zero-bubble schedule, else its B).
    frees = Phase.WEIGHT if schedule.splits_backward else Phase.BACKWARD
    last_loss = max((k for k, a in enumerate(program) if a.stage == last_stage and a.phase is frees),
                    default=-1) if runner == "processes" else -1
    fetched: set[tuple[int, int]] = set()  # offloading cells whose units came back an action ahead (processes)

    def offloaded(stage: int) -> int:
        return candidate.offloaded(stage) if candidate else 0

    for k, action in enumerate(program):
        first, last = bounds[action.stage]
        fresh = besides is not None and k in besides.fresh
        key = (action.microbatch, action.stage)
        ahead = program[k + 1] if k + 1 < len(program) else None
        if runner == "processes" and ahead is not None and ahead.phase is Phase.BACKWARD and offloaded(ahead.stage) \
                and (ahead.microbatch, ahead.stage) in kept:
            # DistributedPipe copies a cell's units back as the action before its backward starts
            # (pipe.distributed.recompute_ranks): all it offloaded is on the device again.
            cell = (ahead.microbatch, ahead.stage)
            back = costs.stage_memory(*bounds[ahead.stage], schedule.microbatches, False,
                                      offloaded=offloaded(ahead.stage), prefetch=-1).fetched
            kept[cell] += back
            held += back
            fetched.add(cell)
        units, prefetch = offloaded(action.stage), 1
        if runner == "processes" and units and action.phase is Phase.BACKWARD:  # back already, or as each is used
            prefetch = -1 if key in fetched else 0
        memory = costs.stage_memory(first, last, schedule.microbatches, action.microbatch < stop,
                                    candidate.recomputed(action.stage) if candidate else 0, schedule.splits_backward,
                                    fresh, candidate.selected(action.stage) if candidate else 0, units, prefetch,
                                    candidate.blocks if candidate else "")
        posted = incoming(program[k + 1]) if runner == "processes" and k + 1 < len(program) else 0
        posted += besides.during[k] if besides is not None else 0
        if action.phase is Phase.FORWARD:
            peak = max(peak, held + sent + posted + scalars + memory.forward_peak)
            kept[key] = memory.kept
            held += memory.kept
            if runner == "processes" and action.stage == last_stage:
                scalars = LOSS_SCALAR_BYTES
            if runner == "processes" and remote(action.stage + 1):  # the output is sent: its header now
                sent += HEADER_BYTES + (sent_copy_bytes(sizes[last - 1]) if sizes else 0)  # small: a copy too
        elif action.phase is Phase.WEIGHT:  # the graph I kept goes, after W's own high-water mark
            peak = max(peak, held + sent + posted + scalars + memory.weight_peak)
            held -= kept.pop(key)
        else:
            backward_peak = memory.backward_peak
            if besides is not None and k in besides.all_reduced:  # HSDP keeps all-reduced shards (see there)
                backward_peak = backward_peak_with_shards(memory, candidate.dp_shard if candidate else 1,
                                                          *besides.all_reduced[k])
            peak = max(peak, held + sent + posted + scalars + backward_peak)
            if action.phase is Phase.BACKWARD:
                held -= kept.pop(key)
            else:  # I: the gradients recorded at the branch nodes (and a replayed graph) wait for W
                kept[key] += memory.after_input
                held += memory.after_input
            if runner == "processes" and sizes:  # the sent output (kept until now, unless copied) and input
                sent += (sizes[last - 1] - sent_copy_bytes(sizes[last - 1])  # gradient (or its copy) stay
                         if remote(action.stage + 1) else 0) + (
                    HEADER_BYTES + grads[first - 1] if remote(action.stage - 1) else 0)
        if k == last_loss:  # the last stage's last cell let go of its loss: the running sum stays
            scalars -= LOSS_SCALAR_BYTES // 2
        if besides is not None and k in besides.copied:  # the averager copies the stage's gradients after the
            # action, which has let go of the gradient it received; the copies stay to the step's end
            peak = max(peak, held + sent + scalars + posted - besides.during[k] + besides.copied[k])
    return peak
