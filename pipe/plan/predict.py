"""Prediction: a candidate plan's step time and each rank's peak memory, from costs.

Time comes from the schedule simulator itself (:meth:`pipe.core.schedule.Schedule.simulate`
with each action's measured duration), not from a formula, so a prediction
follows the same order of actions that the runners execute. Memory follows the
same programs (:meth:`Schedule.actions`): walking a rank's program, a forward
adds its micro-batch's kept bytes (checkpointed or not, by ``checkpoint_stop``),
a backward frees them; the peak is the largest of "held + this forward's
high-water mark" and "held + this backward's high-water mark"::

    rank 1, GPipe, M=3:  F0 F1 F2 B2 B1 B0
    held (kept bytes):   k  2k 3k 2k k  0     peak = 2k + forward_peak, or 3k + backward_peak
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pipe.core.options import checkpoint_stop
from pipe.core.schedule import Action, Phase, Schedule, TimedAction
from pipe.core.message import HEADER_BYTES
from pipe.plan.cost import Costs

__all__ = ["Candidate", "Prediction", "calibrate", "predict"]


@dataclass(frozen=True)
class Candidate:
    """One plan: what ``Pipe`` or ``DistributedPipe`` is told.

    Attributes:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (``Pipe`` runs GPipe).
        chunks: micro-batches per mini-batch.
        balance: layers per stage (``ranks x virtual_stages`` entries).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``.
        virtual_stages: stages per rank (interleaved only).
    """

    schedule: str
    chunks: int
    balance: tuple[int, ...]
    checkpoint: str
    virtual_stages: int = 1

    @property
    def ranks(self) -> int:
        return len(self.balance) // self.virtual_stages

    def describe(self) -> str:
        extra = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{self.schedule}{extra} chunks={self.chunks} balance={list(self.balance)} "
                f"checkpoint={self.checkpoint}")


@dataclass
class Prediction:
    """What a candidate is predicted to cost.

    Attributes:
        step_time: seconds of one training step (the simulated makespan).
        peaks: bytes per rank at its high-water mark (static + activations).
        static: bytes per rank of parameters, gradients and optimiser state.
        timeline: the simulated timed actions (seconds).
    """

    candidate: Candidate
    step_time: float
    peaks: list[int]
    static: list[int]
    timeline: list[TimedAction] = field(repr=False, default_factory=list)

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


def predict(costs: Costs, candidate: Candidate, *, runner: str = "threads", timeline: bool = True) -> Prediction:
    """Step time and per-rank peak bytes of ``candidate``, from ``costs``.

    Raises:
        ValueError: the candidate does not fit the model (its balance does not
            cover the layers, or a schedule argument is out of range).
    """
    schedule = Schedule(candidate.schedule, ranks=candidate.ranks, microbatches=candidate.chunks,
                        virtual_stages=candidate.virtual_stages)
    if sum(candidate.balance) != costs.layers or min(candidate.balance) < 1:
        raise ValueError(f"balance {list(candidate.balance)} does not split {costs.layers} layers into non-empty "
                         f"stages; its entries must be >= 1 and sum to {costs.layers}")
    bounds = _bounds(candidate.balance)
    stop = checkpoint_stop(candidate.checkpoint, candidate.chunks)
    times = [costs.stage_time(first, last, candidate.chunks) for first, last in bounds]

    def duration(action: Action) -> float:
        t = times[action.stage]
        if action.phase is Phase.FORWARD:
            return t.forward
        if action.phase is Phase.BACKWARD:
            return t.backward
        return t.recompute

    simulated = schedule.simulate(checkpoint_stop=stop, durations=duration)
    step_time = max(t.end for t in simulated)
    peaks, static = [], []
    for rank in range(schedule.ranks):
        fixed = sum(costs.static_bytes(*bounds[s]) for s in schedule.stages_of(rank))
        peaks.append(fixed + _activation_peak(costs, schedule, rank, bounds, stop, runner))
        static.append(fixed)
    return Prediction(candidate, step_time, peaks, static, simulated if timeline else [])


def _activation_peak(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]],
                     stop: int, runner: str = "threads") -> int:
    """The high-water mark of activation bytes along ``rank``'s program.

    With ``runner="processes"`` the process runner's buffers count too
    (:mod:`pipe.distributed.runtime`): the receive of the next action is
    posted (its buffer allocated) before this action runs, and a sent tensor
    (an activation, or an input gradient) stays referenced by its pending
    send until the step's end at the latest; each message has a header of
    ``HEADER_BYTES``.
    """
    held = peak = 0
    kept: dict[tuple[int, int], int] = {}
    program = schedule.actions(rank)
    rows = costs.rows(schedule.microbatches)
    sizes = costs.output_bytes.get(rows, [])
    last_stage = schedule.stages - 1

    def incoming(action: Action) -> int:  # bytes of the message an action waits for, with its header
        first, stop_ = bounds[action.stage]
        if action.phase is Phase.FORWARD:
            return HEADER_BYTES + sizes[first - 1] if action.stage > 0 and sizes else 0
        return HEADER_BYTES + sizes[stop_ - 1] if action.stage < last_stage and sizes else 0

    sent = lingering = 0
    latest: Action | None = None  # the rank's latest forward
    for k, action in enumerate(program):
        first, last = bounds[action.stage]
        memory = costs.stage_memory(first, last, schedule.microbatches, action.microbatch < stop)
        key = (action.microbatch, action.stage)
        posted = incoming(program[k + 1]) if runner == "processes" and k + 1 < len(program) else 0
        if action.phase is Phase.FORWARD:
            peak = max(peak, held + sent + posted + lingering + memory.forward_peak)
            kept[key] = memory.kept
            held += memory.kept
            lingering, latest = 0, action
            if runner == "processes" and action.stage < last_stage:  # the output is sent: its header now
                sent += HEADER_BYTES
        else:
            peak = max(peak, held + sent + posted + lingering + memory.backward_peak)
            held -= kept.pop(key)
            if runner == "processes" and sizes:  # the sent output (kept until now) and input gradient stay
                sent += (sizes[last - 1] if action.stage < last_stage else 0) + (
                    HEADER_BYTES + sizes[first - 1] if action.stage > 0 else 0)
            if runner == "processes" and sizes and action.stage == last_stage and latest is not None and (
                    latest.microbatch, latest.stage) == key:
                # The runner's step loop still references the latest forward's output and loss until
                # the next forward; measured: two output-sized tensors outlive the backward.
                lingering = 2 * sizes[last - 1]
    return peak


def calibrate(costs: Costs, candidate: Candidate, measured_step_time: float, *, runner: str = "threads") -> float:
    """Fits ``costs.action_overhead`` so that ``candidate``'s predicted step time is the measured one.

    The layers' times are measured in isolation; a runner adds a cost per
    action (receives, sends, bookkeeping) that one measured step of one plan
    reveals. Other plans are then predicted with it. Returns the overhead (s).

    Raises:
        ValueError: the measured step is faster than the layers alone (then
            the layer times were measured under load: profile again).
    """
    costs.action_overhead = 0.0
    base = predict(costs, candidate, runner=runner, timeline=False).step_time
    if measured_step_time < base:
        raise ValueError(
            f"measured step time {measured_step_time * 1e3:.3f} ms is below the {base * 1e3:.3f} ms the layers "
            f"alone take in {candidate.describe()}; profile the layers again on an idle machine")
    low, high = 0.0, measured_step_time
    for _ in range(60):
        costs.action_overhead = (low + high) / 2
        if predict(costs, candidate, runner=runner, timeline=False).step_time < measured_step_time:
            low = costs.action_overhead
        else:
            high = costs.action_overhead
    costs.action_overhead = (low + high) / 2
    return costs.action_overhead
