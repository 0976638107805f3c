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
from dataclasses import dataclass
from typing import Callable, Sequence

from pipe.core.lowering import COMPUTE, Kind, Routes, Step, lower
from pipe.core.schedule import Action, Phase, Schedule, TimedAction

__all__: list[str] = []

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
    ranks = len(programs)
    sent: dict[tuple[int, int, str, str, int], tuple[float, float]] = {}  # message -> (when sent, transfer)
    posted: dict[tuple[int, int, str, str, int], float] = {}  # message -> when its receive was posted
    gathered: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its last gather ends
    clock = [0.0] * ranks
    comm = [0.0] * ranks  # when each rank's communication lane is free
    sends_done = [0.0] * ranks
    cursor = [0] * ranks
    timeline: list[TimedStep] = []
    waiting: dict[tuple[int, int, str, str, int], list[int]] = {}
    ready = collections.deque(range(ranks))
    while ready:
        rank = ready.popleft()
        program, at = programs[rank], clock[rank]
        position = cursor[rank]
        while position < len(program):
            step = program[position]
            kind = step.kind
            if kind is Kind.WAIT_RECV:
                key = step.message()
                if key not in sent:
                    waiting.setdefault(key, []).append(rank)
                    break
                when, transfer = sent[key]
                arrival = max(when, posted.get(key, when)) + transfer
                if arrival > at:
                    timeline.append(TimedStep(step, rank, at, arrival))
                    at = arrival
            elif kind is Kind.POST_RECV:
                posted[step.message()] = at
            elif kind in COMPUTE or kind is Kind.RECOMPUTE:
                length = cost(step)
                timeline.append(TimedStep(step, rank, at, at + length))
                at += length
            elif kind is Kind.SEND:
                key = step.message()
                sent[key] = (at, cost(step))
                sends_done[rank] = max(sends_done[rank], at + sent[key][1])  # (as if posted: the other rank may
                timeline.append(TimedStep(step, rank, at, at + sent[key][1]))  # not be simulated that far)
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            elif kind in _ON_COMM:
                start = max(at, comm[rank])
                comm[rank] = start + cost(step)
                timeline.append(TimedStep(step, rank, start, comm[rank]))
                if kind is Kind.UNSHARD:
                    gathered[(rank, step.stage)] = comm[rank]
            elif kind is Kind.PREFETCH:
                timeline.append(TimedStep(step, rank, at, at + cost(step)))
            elif kind in (Kind.WAIT_UNSHARD, Kind.FLUSH, Kind.FINISH_REPLICAS):
                until = gathered.get((rank, step.stage), at) if kind is Kind.WAIT_UNSHARD \
                    else sends_done[rank] if kind is Kind.FLUSH else comm[rank]
                if until > at:
                    timeline.append(TimedStep(step, rank, at, until))
                    at = until
            position += 1
        cursor[rank], clock[rank] = position, at
    stuck = [f"rank {rank} at {programs[rank][cursor[rank]]}" for rank in range(ranks)
             if cursor[rank] < len(programs[rank])]
    if stuck:
        raise RuntimeError("the lowered programs deadlock, each rank waiting for a message never sent: "
                           + "; ".join(stuck))
    return sorted(timeline, key=lambda t: (t.start, t.rank, t.end))


def lowered_programs(schedule: Schedule, checkpoint_stop: int) -> list[list[Step]]:
    """Every rank's lowered program (:mod:`pipe.core.lowering`), the one the process runner executes."""
    routes = Routes.chain(schedule.stages)
    return [lower(schedule.actions(rank), routes, checkpoint_stop=checkpoint_stop, post_ahead=schedule.post_ahead(rank))
            for rank in range(schedule.ranks)]


def time_programs(programs: list[list[Step]], duration: Callable[[Action], float],
                  transfer: Callable[[Action], float]) -> list[TimedAction]:
    """The lowered ``programs`` timed (:func:`pipe.core.program_time.simulate`): each compute step takes
    ``duration(action)``, a recompute ``duration`` of its ``R`` action, and a message ``transfer`` of the action
    that waits for it. Returns the compute and recompute steps as timed actions (a recompute of no time left out)."""

    def cost(step: Step) -> float:
        if step.kind in COMPUTE:
            return duration(step.action)
        if step.kind is Kind.RECOMPUTE:
            return duration(Action(Phase.RECOMPUTE, step.microbatch, step.stage))
        if step.kind is Kind.SEND:  # the action on the peer stage that waits for this message
            return transfer(Action(step.action.phase, step.microbatch, step.peer))
        return 0.0

    timed = []
    for t in simulate(programs, cost):
        if t.step.kind in COMPUTE:
            timed.append(TimedAction(t.step.action, t.rank, t.start, t.end))
        elif t.step.kind is Kind.RECOMPUTE and t.end > t.start:
            timed.append(TimedAction(Action(Phase.RECOMPUTE, t.step.microbatch, t.step.stage), t.rank, t.start, t.end))
    return timed


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
