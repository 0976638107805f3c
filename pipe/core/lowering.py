"""Lowering: a rank's compute program, made into every step the rank takes.

A schedule (:mod:`pipe.core.schedule`) says in which order a rank runs the
forwards and backwards of its stages. Running them takes more: the receives
of each action's inputs, posted ahead and waited for; the sends of its
outputs; FSDP's gathers, reduce-scatters and reshards; a checkpointed cell's
recomputation ahead of its gradient; offload to host memory and the prefetch
back; the replicas' gradient reduction. :func:`lower` turns one rank's program
into that whole list, as data: one :class:`Step` per thing the rank does, in
the order it does it. The process runner executes the list by step kind
(:mod:`pipe.distributed.runtime`), :func:`simulate` times it (so sends,
waits and gathers appear in predictions), and ``pipe-viz plan`` draws it.

Each feature is one pass that adds its steps around the compute actions
(:func:`messages`, :func:`gathers`, :func:`recompute`, :func:`offload`,
:func:`replicas`); :func:`check` validates the lowered programs of all ranks:
every send has its receive, every wait its post, a stage computes only while
gathered, and no rank waits for a step that never comes. The module imports
no torch.

Example (rank 0 of a 1F1B pipeline of 2 ranks, 2 micro-batches, FSDP stages):
    >>> from pipe.core.schedule import Schedule
    >>> s = Schedule("1f1b", ranks=2, microbatches=2)
    >>> for step in lower(s.actions(0), Routes.chain(s.stages), zero3=False):
    ...     print(step)  # doctest: +NORMALIZE_WHITESPACE
    UNSHARD 0
    WAIT_UNSHARD 0
    F0@0
    SEND act main F0@0->1
    POST_RECV grad main B0@0<-1
    F1@0
    SEND act main F1@0->1
    WAIT_RECV grad main B0@0<-1
    POST_RECV grad main B1@0<-1
    B0@0
    WAIT_RECV grad main B1@0<-1
    B1@0
    REDUCE_GRAD 0
    RESHARD 0
    FLUSH
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pipe.core.action import Action, Phase

__all__: list[str] = []

MAIN = "main"  # the channel of the activations flowing stage to stage


class Kind(str, enum.Enum):
    """What a step of a lowered program does."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT = "I"
    WEIGHT = "W"
    POST_RECV = "POST_RECV"  # post the receive of a message (returns at once)
    WAIT_RECV = "WAIT_RECV"  # wait until a posted message is here
    SEND = "SEND"  # send an output or gradient (completes in the background)
    RECOMPUTE = "RECOMPUTE"  # replay a checkpointed cell's forward ahead of its gradient
    UNSHARD = "UNSHARD"  # start gathering an FSDP stage's parameters
    WAIT_UNSHARD = "WAIT_UNSHARD"  # wait for that gather
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce-scatter an FSDP stage's gradients (its last backward is done)
    RESHARD = "RESHARD"  # free an FSDP stage's gathered parameters
    OFFLOAD = "OFFLOAD"  # what the action's forward saves goes to host memory, tagged with its cell
    PREFETCH = "PREFETCH"  # start copying a later backward's saved tensors back from host memory
    REDUCE_REPLICAS = "REDUCE_REPLICAS"  # start averaging a stage's gradients over its replicas
    FINISH_REPLICAS = "FINISH_REPLICAS"  # wait for those averages
    FLUSH = "FLUSH"  # wait until every send of the step completed


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT})

#: The name of each step that takes time in a trace (:mod:`pipe.trace`) and a drawing (``pipe-viz``).
TRACE_KINDS: dict[Kind, str] = {
    Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.INPUT: "input", Kind.WEIGHT: "weight",
    Kind.RECOMPUTE: "recompute", Kind.SEND: "send", Kind.WAIT_RECV: "recv", Kind.WAIT_UNSHARD: "gather",
    Kind.FLUSH: "recv", Kind.FINISH_REPLICAS: "reduce", Kind.UNSHARD: "gather", Kind.REDUCE_GRAD: "reduce",
    Kind.REDUCE_REPLICAS: "reduce", Kind.PREFETCH: "copy",
}
MESSAGES = frozenset({Kind.POST_RECV, Kind.WAIT_RECV, Kind.SEND})


@dataclass(frozen=True)
class Step:
    """One step of a lowered program.

    Attributes:
        kind: what the step does.
        action: the compute action the step serves (its own action for F, B, I, W).
        stage: the stage it concerns (the gathered stage, the sending or receiving stage).
        peer: for messages, the stage at the other end.
        direction: for messages, ``"act"`` (forward) or ``"grad"`` (backward).
        channel: for messages, the channel's name (``"main"`` or a skip's).
        ahead: for a prefetch, how many compute actions before its backward it starts.
    """

    kind: Kind
    action: Action
    stage: int
    peer: int = -1
    direction: str = ""
    channel: str = ""
    ahead: int = 0

    @property
    def microbatch(self) -> int:
        return self.action.microbatch

    def message(self) -> tuple[int, int, str, str, int]:
        """The message a send or receive moves: ``(from stage, to stage, direction, channel, micro-batch)``."""
        src, dst = (self.stage, self.peer) if self.kind is Kind.SEND else (self.peer, self.stage)
        return src, dst, self.direction, self.channel, self.action.microbatch

    def __str__(self) -> str:
        if self.kind in COMPUTE:
            return str(self.action)
        if self.kind in MESSAGES:
            arrow = "->" if self.kind is Kind.SEND else "<-"
            return f"{self.kind.value} {self.direction} {self.channel} {self.action}{arrow}{self.peer}"
        if self.kind is Kind.PREFETCH:
            return f"PREFETCH {self.action} (ahead {self.ahead})"
        if self.kind in (Kind.RECOMPUTE, Kind.OFFLOAD):
            return f"{self.kind.value} {self.action}"
        return f"{self.kind.value} {self.stage}" if self.kind is not Kind.FLUSH and self.kind is not Kind.FINISH_REPLICAS \
            else self.kind.value


@dataclass
class Routes:
    """Which stages exchange messages: the chain, and the skips that cross stages.

    Attributes:
        stages: how many stages the model has.
        arriving: per stage, ``(source stage, channel)`` of each skip it receives.
        leaving: per stage, ``(destination stage, channel)`` of each skip it sends.
    """

    stages: int
    arriving: list[list[tuple[int, str]]] = field(default_factory=list)
    leaving: list[list[tuple[int, str]]] = field(default_factory=list)

    @classmethod
    def chain(cls, stages: int, skips: Iterable[tuple[int, int, str]] = ()) -> "Routes":
        """Stage to stage, plus ``skips`` given as ``(source stage, destination stage, channel)``."""
        routes = cls(stages, [[] for _ in range(stages)], [[] for _ in range(stages)])
        for src, dst, name in skips:
            routes.leaving[src].append((dst, name))
            routes.arriving[dst].append((src, name))
        return routes

    def channels(self) -> list[tuple[int, int, str]]:
        """Every ``(source stage, destination stage, channel)`` that carries activations (gradients go back)."""
        return [(s, s + 1, MAIN) for s in range(self.stages - 1)] + [
            (src, dst, name) for src, leaving in enumerate(self.leaving) for dst, name in leaving]


@dataclass
class _Slot:
    """The steps before and after one compute action."""

    action: Action
    before: list[Step] = field(default_factory=list)
    after: list[Step] = field(default_factory=list)


def _receives(action: Action, routes: Routes) -> list[Step]:
    s, last = action.stage, routes.stages - 1
    steps: list[Step] = []
    if action.phase is Phase.FORWARD:
        if s > 0:
            steps.append(Step(Kind.POST_RECV, action, s, s - 1, "act", MAIN))
        steps += [Step(Kind.POST_RECV, action, s, src, "act", name) for src, name in routes.arriving[s]]
    elif action.phase is not Phase.WEIGHT:
        if s < last:
            steps.append(Step(Kind.POST_RECV, action, s, s + 1, "grad", MAIN))
        steps += [Step(Kind.POST_RECV, action, s, dst, "grad", name) for dst, name in routes.leaving[s]]
    return steps


def _sends(action: Action, routes: Routes) -> list[Step]:
    s, last = action.stage, routes.stages - 1
    steps: list[Step] = []
    if action.phase is Phase.FORWARD:
        steps += [Step(Kind.SEND, action, s, dst, "act", name) for dst, name in routes.leaving[s]]
        if s < last:
            steps.append(Step(Kind.SEND, action, s, s + 1, "act", MAIN))
    elif action.phase is not Phase.WEIGHT and s > 0:
        steps.append(Step(Kind.SEND, action, s, s - 1, "grad", MAIN))
        steps += [Step(Kind.SEND, action, s, src, "grad", name) for src, name in routes.arriving[s]]
    return steps


# -- the passes -----------------------------------------------------------------------------------


def gathers(slots: list[_Slot], zero3: bool, training: bool, reduce: bool = True) -> list[tuple[int, list[Step]]]:
    """FSDP: gather before use (the next action's stage is prefetched), reduce after the last backward, reshard.

    Before action k the stages of actions k and k + 1 are gathered. ZeRO-3
    (``zero3``) reshards a stage as soon as neither needs it; ZeRO-2 after the
    stage's last action. A stage is reduced after its last backward (``B``, or
    ``W`` in zero-bubble schedules) when ``training`` and ``reduce`` (a pass that
    accumulates leaves its gradients unreduced, FSDP keeps them unsharded). Adds the gathers to
    ``before``; returns the reduces and reshards, per slot, for :func:`lower`
    to place after every other pass's steps.
    """
    program = [slot.action for slot in slots]
    last = {a.stage: k for k, a in enumerate(program)}
    last_backward = {a.stage: k for k, a in enumerate(program) if a.phase in (Phase.BACKWARD, Phase.WEIGHT)}
    after: list[list[Step]] = [[] for _ in program]
    active: list[int] = []
    unwaited: set[int] = set()
    for k, action in enumerate(program):
        wanted = [action.stage] + [a.stage for a in program[k + 1:k + 2] if a.stage != action.stage]
        if zero3 and k:
            for s in [s for s in active if s not in wanted]:
                active.remove(s)
                unwaited.discard(s)
                after[k - 1].append(Step(Kind.RESHARD, program[k - 1], s))
        for s in wanted:
            if s not in active:
                active.append(s)
                unwaited.add(s)
                slots[k].before.append(Step(Kind.UNSHARD, action, s))
        if action.stage in unwaited:
            unwaited.discard(action.stage)
            slots[k].before.append(Step(Kind.WAIT_UNSHARD, action, action.stage))
        if training and reduce and last_backward.get(action.stage) == k:
            after[k].append(Step(Kind.REDUCE_GRAD, action, action.stage))
        if last[action.stage] == k:
            active.remove(action.stage)
            unwaited.discard(action.stage)
            after[k].append(Step(Kind.RESHARD, action, action.stage))
    return [(k, steps) for k, steps in enumerate(after) if steps]


@dataclass
class GatherEvents:
    """The FSDP steps around one action: stages gathered before it, reduced and resharded after it."""

    unshard: list[int]
    reduce: list[int]
    reshard: list[int]


def gather_events(program: Sequence[Action], zero3: bool, training: bool) -> list[GatherEvents]:
    """Per action of ``program``, the FSDP steps :func:`gathers` places around it (for the planner's counts)."""
    slots = [_Slot(a) for a in program]
    late = dict(gathers(slots, zero3, training))
    return [GatherEvents([x.stage for x in slot.before if x.kind is Kind.UNSHARD],
                         [x.stage for x in late.get(k, []) if x.kind is Kind.REDUCE_GRAD],
                         [x.stage for x in late.get(k, []) if x.kind is Kind.RESHARD])
            for k, slot in enumerate(slots)]


def recompute(slots: list[_Slot], checkpoint_stop: int) -> None:
    """A checkpointed cell (micro-batch ``< checkpoint_stop``) replays its forward before its backward's wait."""
    for slot in slots:
        a = slot.action
        if a.phase in (Phase.BACKWARD, Phase.INPUT) and a.microbatch < checkpoint_stop:
            slot.before.append(Step(Kind.RECOMPUTE, a, a.stage))


def messages(slots: list[_Slot], routes: Routes, ahead: int = 1) -> list[Step]:
    """Each action waits for its messages, posts the receives of the action ``ahead`` later, then sends
    what it made (``ahead=0``: each action posts its own receives just before it waits for them).

    Returns the receives of the first ``ahead`` actions, posted before anything else.
    """
    receives = [_receives(slot.action, routes) for slot in slots]  # each action's, built once
    for k, slot in enumerate(slots):
        own = receives[k]
        if ahead == 0:
            slot.before += own
        slot.before += [Step(Kind.WAIT_RECV, r.action, r.stage, r.peer, r.direction, r.channel) for r in own]
        if ahead and k + ahead < len(slots):
            slot.before += receives[k + ahead]
        slot.after += _sends(slot.action, routes)
    return [r for own in receives[:ahead] for r in own]


def offload(slots: list[_Slot], stages: Sequence[int], horizon: int) -> None:
    """Offload: each action tags what its forward saves; the backwards ``horizon`` actions ahead are prefetched.

    ``stages``: the stages whose saved tensors go to host memory. The tag
    step is added to every action (the offloaders record the order of the
    actions they saw), the prefetches only for offloading stages.
    """
    offloading = set(stages)
    for k, slot in enumerate(slots):
        slot.before.append(Step(Kind.OFFLOAD, slot.action, slot.action.stage))
        for b in range(k + 1, min(len(slots), k + 1 + horizon)):
            ahead = slots[b].action
            if ahead.phase is Phase.BACKWARD and ahead.stage in offloading:
                slot.before.append(Step(Kind.PREFETCH, ahead, ahead.stage, ahead=b - k))


def replicas(slots: list[_Slot]) -> None:
    """Replicas: a stage's gradients start averaging after its last backward of the step."""
    last_backward = {slot.action.stage: k for k, slot in enumerate(slots)
                     if slot.action.phase in (Phase.BACKWARD, Phase.WEIGHT)}
    for s, k in sorted(last_backward.items(), key=lambda item: item[1]):
        slots[k].after.append(Step(Kind.REDUCE_REPLICAS, slots[k].action, s))


def lower(program: Sequence[Action], routes: Routes, *, training: bool = True, checkpoint_stop: int = 0,
          zero3: Optional[bool] = None, offload_stages: Sequence[int] = (), offload_horizon: int = 0,
          replicated: bool = False, post_ahead: int = 1, reduce: bool = True) -> list[Step]:
    """The lowered program of one rank: every step it takes, in order.

    Args:
        program: the rank's compute actions (``Schedule.actions(rank)``);
            forwards only when not ``training``.
        routes: the stages and the skips between them.
        training: backwards run (recompute, gradient reduction) or forwards only.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.
        zero3: None without FSDP; else whether a stage is resharded as soon as
            the program moves to another (ZeRO-3) or after its last action (ZeRO-2).
        offload_stages, offload_horizon: stages that offload to host memory
            and how many actions ahead their backwards are prefetched; the tag
            steps come whenever ``offload_horizon`` is set or stages offload.
        replicated: the stages' gradients are averaged over replicas.
        post_ahead: how many actions ahead a receive is posted (a message's
            bytes move only once its receive is posted; each posted receive
            holds its buffer): 1 by default, 0 just before its wait.
        reduce: ``training`` reduces the gradients (FSDP's reduce-scatter, the
            replicas' average) after each stage's last backward; False for a
            pass that accumulates them locally for a later one to reduce
            (``DistributedPipe.step(..., accumulate=True)``): no reduce step at all.

    The order around action k: gathers, recomputation, the wait for its
    messages, the receives of action k + ``post_ahead``, offload tag and
    prefetches; the action; its sends, the replicas' reduction, the FSDP
    reduce and reshards.
    """
    if isinstance(post_ahead, bool) or not isinstance(post_ahead, int) or post_ahead < 0:
        raise ValueError(f"post_ahead must be an int >= 0 (actions ahead a receive is posted), got {post_ahead!r}")
    program = [a for a in program if training or a.phase is Phase.FORWARD]
    slots = [_Slot(a) for a in program]
    late = gathers(slots, zero3, training, reduce) if zero3 is not None else []
    if training:
        recompute(slots, checkpoint_stop)
    head = messages(slots, routes, post_ahead)
    if offload_stages or offload_horizon:
        offload(slots, offload_stages, offload_horizon)
    if replicated and training and reduce:
        replicas(slots)
    for k, steps in late:
        slots[k].after += steps
    lowered = list(head)
    for slot in slots:
        a = slot.action
        lowered += slot.before
        lowered.append(Step(Kind(a.phase.value), a, a.stage))
        lowered += slot.after
    if program:
        lowered.append(Step(Kind.FLUSH, program[-1], program[-1].stage))
        if replicated and training and reduce:
            lowered.append(Step(Kind.FINISH_REPLICAS, program[-1], program[-1].stage))
    return lowered
