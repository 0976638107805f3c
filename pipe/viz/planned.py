"""Planned timelines: a schedule from :mod:`pipe.core.schedule`, simulated and laid out for drawing.

The picture must show what the engines execute, so nothing here decides an
order: the cells are the timed steps of the ranks' lowered programs
(:mod:`pipe.core.lowering`, :func:`pipe.core.program_time.simulate`) and the
peak in-flight counts are ``Schedule.peak_inflight()``. With
:class:`Communication` costs, marks for sends, waits for messages, FSDP
gathers and reduces join the compute, under the names a measured trace gives
them. This module only names the rows, picks durations and writes the title.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipe.core.stage_costs import StageCosts, action_costs
from pipe.core.options import checkpoint_stop, verify_checkpoint
from pipe.core.lowering import COMPUTE, TRACE_KINDS, Kind
from pipe.core.program_time import lowered_programs, phase_durations, simulate, step_cost
from pipe.core.schedule import Schedule
from pipe.viz.timeline import Span, Timeline

__all__: list[str] = []

#: How each schedule kind is named in titles.
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "looped-bfs": "looped BFS", "zb-h1": "ZB-H1", "zbv": "ZB-V"}


@dataclass(frozen=True)
class Communication:
    """What a plan's communication costs, in the plan's unit.

    Attributes:
        transfer: each message between stages (activation or gradient).
        gather: gathering one FSDP stage's parameters.
        reduce: reduce-scattering one FSDP stage's gradients.
        zero3: FSDP stages: None for none, False ZeRO-2 (gathered until the
            stage's last action), True ZeRO-3 (resharded whenever the rank
            moves to another stage).
    """

    transfer: float = 0.0
    gather: float = 0.0
    reduce: float = 0.0
    zero3: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("transfer", "gather", "reduce"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0 (time in the plan's unit), got {value!r}")
        if (self.gather or self.reduce) and self.zero3 is None:
            raise ValueError("gather and reduce times need FSDP stages: pass zero3=True (ZeRO-3) or False (ZeRO-2)")


def schedule_timeline(
    schedule: str = "gpipe",
    ranks: int = 4,
    microbatches: int = 8,
    *,
    virtual_stages: int = 1,
    checkpoint: str = "never",
    forward: float = 1.0,
    backward: float = 2.0,
    recompute: Optional[float] = None,
    communication: Optional[Communication] = None,
) -> Timeline:
    """The planned timeline of a schedule, in time steps (a forward takes ``forward``).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"looped-bfs"``, ``"zb-h1"`` or
            ``"zbv"`` (the last two split each backward in I and W, half each).
        ranks: pipeline ranks (devices, or processes); one row each. Each
            runs ``virtual_stages`` stages.
        microbatches: micro-batches per mini-batch.
        virtual_stages: model chunks per stage (interleaved and looped-bfs; zbv has 2).
        checkpoint: ``Pipe``'s checkpoint mode; checkpointed micro-batches
            recompute their forward before their backward.
        forward, backward: durations of one forward and one backward of a
            whole stage; with virtual stages each model chunk takes
            ``1 / virtual_stages`` of them, so schedules compare on one axis.
        recompute: duration of one recomputation (default: ``forward``).
        communication: the time of messages, gathers and reduces; given, the
            plan is the ranks' lowered programs, with their waits drawn.

    Returns:
        A :class:`Timeline` titled with the configuration and the bubble.

    Raises:
        ValueError: a bad schedule, count, mode or duration (the message names it).

    Example:
        >>> round(schedule_timeline("gpipe", 4, 8).bubble(), 4)  # (K - 1) / (M + K - 1) = 3 / 11
        0.2727
    """
    mode = verify_checkpoint(checkpoint)
    shape = Schedule(schedule, ranks=ranks, microbatches=microbatches, virtual_stages=virtual_stages)
    stop = checkpoint_stop(mode, microbatches)
    share = 1.0 / shape.virtual_stages  # zbv has 2 whatever the argument
    redo = forward if recompute is None else recompute
    timeline = lay_out(shape, forward * share, backward * share, redo * share, stop, communication=communication)
    timeline.title = f"{_describe(shape)} · checkpoint={mode} · bubble {timeline.bubble():.1%}"
    return timeline


def lay_out(
    schedule: Schedule, forward: float, backward: float, recompute: float, stop: int, unit: str = "step",
    split: Optional[tuple[float, float]] = None, communication: Optional[Communication] = None,
    costs: Optional[StageCosts] = None,
) -> Timeline:
    """Lays out ``schedule``'s lowered programs, simulated: micro-batches ``i < stop`` recompute.

    ``split`` gives the I and W durations of a zero-bubble schedule (default:
    half the backward each); ``costs`` instead gives every stage its own
    (:class:`pipe.core.stage_costs.StageCosts`, messages included). The title is a
    plain description; :func:`schedule_timeline` and the trace renderer add to it.
    """
    input_grad, weight_grad = split if split is not None else (backward / 2, backward / 2)
    chunk = {s: schedule.stages_of(schedule.rank_of(s)).index(s) for s in range(schedule.stages)}
    if costs is not None and communication is not None:
        raise ValueError("give costs (each stage's own, messages included) or communication, not both")
    others: dict[Kind, float] = {}
    if costs is not None:
        if costs.stages != schedule.stages:
            raise ValueError(f"costs of {costs.stages} stages for a schedule of {schedule.stages}: give one cost "
                             f"per stage of the schedule")
        duration, transfer = action_costs(schedule, costs)
    else:
        duration = phase_durations(forward, backward, recompute if stop > 0 else 0.0, input_grad=input_grad,
                                   weight_grad=weight_grad)
        transfer = None
        if communication is not None:
            transfer = lambda action: communication.transfer  # noqa: E731 (every message costs the same)
            others = {Kind.UNSHARD: communication.gather, Kind.REDUCE_GRAD: communication.reduce}
    programs = lowered_programs(schedule, stop, communication.zero3 if communication is not None else None)
    cells = []
    for t in simulate(programs, step_cost(duration, transfer, others)):
        kind = t.step.kind
        if kind not in COMPUTE and (t.end <= t.start or (communication is None and kind is not Kind.RECOMPUTE)):
            continue  # a recompute of no time; without communication costs, only the compute is drawn
        stage = t.step.stage if kind is Kind.RECOMPUTE else t.step.action.stage
        cells.append(Span(row=t.rank, kind=TRACE_KINDS[kind], start=t.start, end=t.end,
                          microbatch=t.step.microbatch, stage=stage, chunk=chunk[stage]))
    rows = [f"stage {r}" for r in range(schedule.ranks)]
    notes = [_costs_note(costs, stop, unit)] if costs is not None else [
        f"durations{' per model chunk' if schedule.virtual_stages > 1 else ''}: forward {forward:g}, backward {backward:g}"
        + (f" (I {input_grad:g} + W {weight_grad:g})" if schedule.splits_backward else "")
        + (f", recompute {recompute:g}" if stop > 0 else "") + f" ({'time steps' if unit == 'step' else unit});"
        + (" transfers are free" if communication is None else
           f" each message {communication.transfer:g}"
           + ("" if communication.zero3 is None else f", FSDP (ZeRO-{3 if communication.zero3 else 2}) gather "
              f"{communication.gather:g} and reduce {communication.reduce:g} per stage")
           + "; thin marks: sends, waits for a message (recv), gathers and reduces"),
    ]
    if schedule.splits_backward:
        notes.append("I: input gradient (sent upstream at once); W: weight gradient, deferred into the bubble; "
                     "a checkpointed cell recomputes once, before its I")
    if schedule.kind == "table":
        notes.append("a schedule given as a table; each rank's later stages are drawn lighter (lower case in text)")
    elif schedule.kind == "zbv":
        notes.append("stage r runs the model chunks r and 2p-1-r (a V); the second is drawn lighter (lower case in text)")
    elif schedule.virtual_stages > 1:
        chunks = ", ".join(f"r + {c * schedule.ranks}" if c else "r" for c in range(schedule.virtual_stages))
        notes.append(f"stage r runs the model chunks {chunks}; later chunks are drawn lighter (lower case in text)")
    return Timeline(
        title=_describe(schedule),
        rows=rows,
        cells=cells,
        unit=unit,
        chunks=schedule.virtual_stages,
        peak_inflight=schedule.peak_inflight(),
        notes=notes,
    )


def _costs_note(costs: StageCosts, stop: int, unit: str) -> str:
    def per_stage(values: tuple[float, ...]) -> str:
        return "/".join(f"{v:.3g}" for v in values)

    return (f"durations per stage ({'time steps' if unit == 'step' else unit}): F {per_stage(costs.forward)}, "
            f"I {per_stage(costs.input_grad)}, W {per_stage(costs.weight_grad)}"
            + (", a recompute as its F" if stop > 0 else "")
            + (f"; each message {per_stage(costs.transfer)}" if any(costs.transfer) else "; messages free")
            + (f"; the runner {costs.overhead:.3g} per action" if costs.overhead else ""))


def _describe(schedule: Schedule) -> str:
    name = SCHEDULE_NAMES.get(schedule.kind) or str(getattr(schedule, "name", schedule.kind))
    stages = f"{schedule.ranks} stage{'s' if schedule.ranks != 1 else ''}"
    if schedule.virtual_stages > 1:
        stages += f" × {schedule.virtual_stages} virtual"
    return f"{name} · {stages} · {schedule.microbatches} micro-batch{'es' if schedule.microbatches != 1 else ''}"

