"""Lowered programs on paper: validate them, and time them with sends, waits and gathers.

:func:`check` refuses lowered programs (:mod:`pipe.core.lowering`) that cannot
run: a send nobody receives, a receive nobody sends, a wait with no post, a
stage computed while its FSDP parameters are not gathered, ranks that wait
for each other forever. :func:`simulate` places every step on a timeline
given its cost, with the rules the process runner follows:

* compute steps (F, B, I, W, RECOMPUTE) run one after another on the rank;
* a send returns at once; its message's bytes move once it is sent and its
  receive is posted, and arrive ``cost(send)`` later; a ``WAIT_RECV`` holds
  the rank until its message arrived;
* gathers, reduce-scatters and the replicas' averages run on the rank's
  communication lane, one after another, beside compute; ``WAIT_UNSHARD``
  holds the rank until its gather ended, ``FINISH_REPLICAS`` and ``FLUSH``
  until the lane and the sends are done;
* a prefetch runs on the rank's copy lane.

The module imports no torch.
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Protocol, Sequence

from pipe.core.lowering import COMPUTE, Kind, Routes, Step, lower
from pipe.core.action import Action, Phase, TimedAction

__all__: list[str] = []


class Programs(Hashable, Protocol):
    """What this module times: each rank's program of actions and where it posts its receives
    (:class:`pipe.core.schedule.Schedule` and its tables). Frozen and hashable: lowered programs are cached
    per schedule."""

    @property
    def ranks(self) -> int: ...

    @property
    def stages(self) -> int: ...

    def actions(self, rank: int) -> Sequence[Action]: ...

    def post_ahead(self, rank: int) -> int: ...

#: The lane each kind of step is drawn on (steps of no lane take no time of their own).
LANES: dict[Kind, str] = {**{kind: "compute" for kind in COMPUTE}, Kind.RECOMPUTE: "compute",
                          Kind.WAIT_RECV: "wait", Kind.WAIT_UNSHARD: "wait", Kind.FLUSH: "wait",
                          Kind.FINISH_REPLICAS: "wait", Kind.SEND: "send", Kind.UNSHARD: "comm",
                          Kind.REDUCE_GRAD: "comm", Kind.REDUCE_REPLICAS: "comm", Kind.PREFETCH: "copy"}
_ON_COMM = frozenset({Kind.UNSHARD, Kind.REDUCE_GRAD, Kind.REDUCE_REPLICAS})


@dataclass(frozen=True)
class TimedStep:
    """A step of ``rank``'s lowered program on the simulated timeline, on its ``lane``."""

    step: Step
    rank: int
    start: float
    end: float

    @property
    def lane(self) -> str:
        return LANES[self.step.kind]


def stage_ranks(programs: Sequence[Sequence[Step]]) -> dict[int, int]:
    """The rank that computes each stage, read from the programs."""
    return {step.stage: rank for rank, program in enumerate(programs) for step in program if step.kind in COMPUTE}


# What the simulator does with each kind of step, as small ints (compared with ``==``, not hashed).
_COMPUTE, _SEND, _POST, _WAIT, _COMM, _COPY, _WAIT_UNSHARD, _FLUSH, _FINISH, _NOTHING = range(10)
_OPS = {**{kind: _COMPUTE for kind in COMPUTE}, Kind.RECOMPUTE: _COMPUTE, Kind.SEND: _SEND,
        Kind.POST_RECV: _POST, Kind.WAIT_RECV: _WAIT, **{kind: _COMM for kind in _ON_COMM}, Kind.PREFETCH: _COPY,
        Kind.WAIT_UNSHARD: _WAIT_UNSHARD, Kind.FLUSH: _FLUSH, Kind.FINISH_REPLICAS: _FINISH}

#: A program made ready for the simulator: per step, ``(op, key, step)``; the key is a message's for the
#: message steps, the stage for a gather or its wait.
_Ready = tuple[tuple[tuple[int, object, Step], ...], ...]


def _ready(programs: Sequence[Sequence[Step]]) -> _Ready:
    return tuple(tuple((op, step.message() if op in (_SEND, _POST, _WAIT) else step.stage, step)
                       for step in program for op in (_OPS.get(step.kind, _NOTHING),))
                 for program in programs)


def simulate(programs: Sequence[Sequence[Step]], cost: Callable[[Step], float]) -> list[TimedStep]:
    """Every step of every rank's lowered program on one timeline; see the module docstring.

    Args:
        programs: per rank, its lowered program.
        cost: seconds of a step's own work (a send: until its message arrives).

    Returns:
        The timed steps that take time or wait, sorted by ``(start, rank)``.

    Raises:
        RuntimeError: the programs deadlock; the message names each rank's stuck step.
    """
    return [TimedStep(step, rank, start, end) for start, rank, end, step in sorted(_run(_ready(programs), cost),
                                                                                   key=_order)]


def _order(timed: tuple[float, int, float, Step]) -> tuple[float, int, float]:
    return timed[0], timed[1], timed[2]


def _run(programs: _Ready, cost: Callable[[Step], float]) -> list[tuple[float, int, float, Step]]:
    """:func:`simulate`'s timeline, unsorted, as ``(start, rank, end, step)``."""
    ranks = len(programs)
    sent: dict[object, tuple[float, float]] = {}  # message -> (when sent, transfer)
    posted: dict[object, float] = {}  # message -> when its receive was posted
    gathered: dict[tuple[int, object], float] = {}  # (rank, stage) -> when its last gather ends
    clock = [0.0] * ranks
    comm = [0.0] * ranks  # when each rank's communication lane is free
    sends_done = [0.0] * ranks
    cursor = [0] * ranks
    timeline: list[tuple[float, int, float, Step]] = []
    append = timeline.append
    waiting: dict[object, list[int]] = {}
    ready = collections.deque(range(ranks))
    while ready:
        rank = ready.popleft()
        program, at = programs[rank], clock[rank]
        position, end = cursor[rank], len(programs[rank])
        while position < end:
            op, key, step = program[position]
            if op == _COMPUTE:
                length = cost(step)
                append((at, rank, at + length, step))
                at += length
            elif op == _WAIT:
                if key not in sent:
                    waiting.setdefault(key, []).append(rank)
                    break
                when, transfer = sent[key]
                arrival = max(when, posted.get(key, when)) + transfer
                if arrival > at:
                    append((at, rank, arrival, step))
                    at = arrival
            elif op == _POST:
                posted[key] = at
            elif op == _SEND:
                transfer = cost(step)
                sent[key] = (at, transfer)
                if at + transfer > sends_done[rank]:  # (as if posted: the other rank may not be simulated that far)
                    sends_done[rank] = at + transfer
                append((at, rank, at + transfer, step))
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            elif op == _COMM:
                start = max(at, comm[rank])
                comm[rank] = start + cost(step)
                append((start, rank, comm[rank], step))
                if step.kind is Kind.UNSHARD:
                    gathered[(rank, key)] = comm[rank]
            elif op == _COPY:
                append((at, rank, at + cost(step), step))
            elif op != _NOTHING:
                until = gathered.get((rank, key), at) if op == _WAIT_UNSHARD \
                    else sends_done[rank] if op == _FLUSH else comm[rank]
                if until > at:
                    append((at, rank, until, step))
                    at = until
            position += 1
        cursor[rank], clock[rank] = position, at
    stuck = [f"rank {rank} at {programs[rank][cursor[rank]][2]}" for rank in range(ranks)
             if cursor[rank] < len(programs[rank])]
    if stuck:
        raise RuntimeError("the lowered programs deadlock, each rank waiting for a message never sent: "
                           + "; ".join(stuck))
    return timeline


def lowered_programs(schedule: Programs, checkpoint_stop: int, zero3: Optional[bool] = None
                     ) -> tuple[tuple[Step, ...], ...]:
    """Every rank's lowered program (:mod:`pipe.core.lowering`), the one the process runner executes; FSDP
    stages with ``zero3`` (see :func:`pipe.core.lowering.lower`)."""
    return _lowered(schedule, checkpoint_stop, zero3)[0]


@functools.lru_cache(maxsize=128)
def _lowered(schedule: Programs, checkpoint_stop: int, zero3: Optional[bool]
             ) -> tuple[tuple[tuple[Step, ...], ...], _Ready]:
    """The lowered programs and their form for :func:`_run`, cached per schedule, stop and ``zero3`` (a
    schedule is frozen, its actions a function of its fields), and per rank (:func:`_lowered_rank`)."""
    ranks = [_lowered_rank(tuple(schedule.actions(rank)), schedule.stages, checkpoint_stop, zero3,
                           schedule.post_ahead(rank)) for rank in range(schedule.ranks)]
    return tuple(steps for steps, _ in ranks), tuple(ready for _, ready in ranks)


@functools.lru_cache(maxsize=4096)
def _lowered_rank(actions: tuple[Action, ...], stages: int, checkpoint_stop: int, zero3: Optional[bool],
                  post_ahead: int) -> tuple[tuple[Step, ...], tuple[tuple[int, object, Step], ...]]:
    """One rank's lowered program and its form for :func:`_run`, cached per program of actions (a rank's
    lowering depends on its own actions, the stage count, the stop, ``zero3`` and its posts alone): the
    planner times one table under many costs, and the order search tries tables that differ on one rank,
    so a prediction mostly costs the simulation alone."""
    steps = tuple(lower(actions, Routes.chain(stages), checkpoint_stop=checkpoint_stop, zero3=zero3,
                        post_ahead=post_ahead))
    return steps, _ready([steps])[0]


def step_cost(duration: Callable[[Action], float], transfer: Optional[Callable[[Action], float]] = None,
              others: Optional[Mapping[Kind, float]] = None) -> Callable[[Step], float]:
    """The seconds of each step of a lowered program, from the costs of actions: a compute step takes
    ``duration(action)``, a recompute ``duration`` of its ``R`` action, a send ``transfer`` of the action on
    the peer stage that waits for its message (free without ``transfer``), and a step of another kind its
    entry in ``others`` (a gather, a reduce; 0 if none)."""
    recompute = Phase.RECOMPUTE
    others = others or {}

    def cost(step: Step) -> float:
        kind = step.kind
        if kind in COMPUTE:
            return duration(step.action)
        if kind is Kind.RECOMPUTE:
            return duration(Action(recompute, step.action.microbatch, step.stage))
        if kind is Kind.SEND:
            return transfer(Action(step.action.phase, step.action.microbatch, step.peer)) if transfer else 0.0
        return others.get(kind, 0.0)

    return cost


def time_schedule(schedule: Programs, duration: Optional[Callable[[Action], float]] = None,
                  transfer: Optional[Callable[[Action], float]] = None, checkpoint_stop: int = 0
                  ) -> list[TimedAction]:
    """``schedule`` timed: its ranks' lowered programs (:func:`lowered_programs`, micro-batches ``i <
    checkpoint_stop`` recomputed ahead of their gradient) through :func:`simulate`, each action taking
    ``duration(action)`` (default :func:`phase_durations`: F 1, B 2) and each message between ranks
    ``transfer`` of the action that waits for it (default: free). The one way the library times a schedule.

    Returns:
        The compute and recompute steps as timed actions, sorted by ``(start, rank)``.

    Raises:
        RuntimeError: the programs deadlock; the message names each rank's stuck step.
    """
    timeline = _run(_lowered(schedule, checkpoint_stop, None)[1], step_cost(duration or phase_durations(), transfer))
    timed = []
    for start, rank, end, step in timeline:
        if step.kind in COMPUTE:
            timed.append(TimedAction(step.action, rank, start, end))
        elif step.kind is Kind.RECOMPUTE and end > start:
            timed.append(TimedAction(Action(Phase.RECOMPUTE, step.microbatch, step.stage), rank, start, end))
    timed.sort(key=_timed_order)
    return timed


def makespan(schedule: Programs, duration: Optional[Callable[[Action], float]] = None,
             transfer: Optional[Callable[[Action], float]] = None, checkpoint_stop: int = 0) -> float:
    """When the last compute step of :func:`time_schedule`'s timeline ends (its arguments), without building
    and sorting the timed actions: what the order search and the planner compare, thousands of times."""
    timeline = _run(_lowered(schedule, checkpoint_stop, None)[1], step_cost(duration or phase_durations(), transfer))
    return max((end for _, _, end, step in timeline if step.kind in _TIMED), default=0.0)


_TIMED = frozenset(COMPUTE) | {Kind.RECOMPUTE}


def _timed_order(timed: TimedAction) -> tuple[float, int, float]:
    return timed.start, timed.rank, timed.end


def phase_durations(forward: float = 1.0, backward: float = 2.0, recompute: float = 0.0, *,
                    input_grad: Optional[float] = None, weight_grad: Optional[float] = None
                    ) -> Callable[[Action], float]:
    """Every action's duration by its phase alone (I and W default to half a backward each), for
    :func:`time_schedule`; relative units, e.g. ``forward=1.0, backward=2.0``.

    Raises:
        ValueError: a duration that is not a finite number in range (> 0; a recompute >= 0).
    """
    input_grad = backward / 2 if input_grad is None else input_grad
    weight_grad = backward / 2 if weight_grad is None else weight_grad
    for name, value, least in (("forward", forward, "> 0"), ("backward", backward, "> 0"),
                               ("recompute", recompute, ">= 0"), ("input_grad", input_grad, "> 0"),
                               ("weight_grad", weight_grad, "> 0")):
        positive = value > 0 if least == "> 0" else value >= 0
        if isinstance(value, bool) or not math.isfinite(value) or not positive:
            raise ValueError(f"{name} duration must be a finite number {least} (got {value!r}); "
                             f"durations are relative, e.g. forward=1.0, backward=2.0")
    lengths = {Phase.FORWARD: forward, Phase.BACKWARD: backward, Phase.RECOMPUTE: recompute,
               Phase.INPUT: input_grad, Phase.WEIGHT: weight_grad}
    return lambda action: lengths[action.phase]


def check(programs: Sequence[Sequence[Step]]) -> None:
    """Checks that lowered programs can run, naming the first step that breaks them.

    Raises:
        ValueError: a send with no receive (or the reverse), a message sent or
            posted twice, a wait before its post, a stage computed while not
            gathered (when the rank gathers at all), or a deadlock.
    """
    owner = stage_ranks(programs)
    posted: dict[tuple[int, int, str, str, int], int] = {}
    sent: dict[tuple[int, int, str, str, int], int] = {}
    for rank, program in enumerate(programs):
        seen_posts: set[tuple[int, int, str, str, int]] = set()
        gathers = any(step.kind is Kind.UNSHARD for step in program)
        gathered: set[int] = set()
        for step in program:
            kind = step.kind
            if kind in (Kind.POST_RECV, Kind.SEND):
                key = step.message()
                table = posted if kind is Kind.POST_RECV else sent
                if key in table:
                    raise ValueError(f"rank {rank}: {step} moves a message that is already "
                                     f"{'posted' if kind is Kind.POST_RECV else 'sent'} on rank {table[key]}")
                table[key] = rank
                if kind is Kind.POST_RECV:
                    seen_posts.add(key)
            elif kind is Kind.WAIT_RECV and step.message() not in seen_posts:
                raise ValueError(f"rank {rank}: {step} waits for a receive it has not posted")
            elif kind is Kind.WAIT_UNSHARD:
                gathered.add(step.stage)
            elif kind is Kind.RESHARD:
                gathered.discard(step.stage)
            elif gathers and (kind in COMPUTE or kind is Kind.RECOMPUTE) and step.stage not in gathered:
                raise ValueError(f"rank {rank}: {step} runs while stage {step.stage}'s parameters are not gathered")
    for key, rank in sent.items():
        src, dst = key[0], key[1]
        if key not in posted:
            raise ValueError(f"rank {rank}: stage {src} sends {key[2]} {key[3]} of micro-batch {key[4]} to stage "
                             f"{dst} but rank {owner.get(dst, '?')} never posts its receive")
    for key, rank in posted.items():
        if key not in sent:
            raise ValueError(f"rank {rank}: stage {key[1]} posts a receive of {key[2]} {key[3]} of micro-batch "
                             f"{key[4]} from stage {key[0]}, which rank {owner.get(key[0], '?')} never sends")
    try:
        simulate(programs, lambda step: 1.0)
    except RuntimeError as error:
        raise ValueError(str(error)) from None
