"""Which FSDP stages a rank gathers, reduces and reshards around each action of its program: data, no torch.

:func:`sharding_plan` walks a rank's program (:meth:`pipe.core.schedule.Schedule.actions`)
once; the runner's :class:`pipe.distributed.fsdp.StageSharding` follows it,
and the planner (:mod:`pipe.plan.sharding`) counts the same gathers and
collectives from it, so the two cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipe.core.schedule import Action, Phase

__all__: list[str] = []


@dataclass
class Event:
    """What the runner does to FSDP stages around one action of the program."""

    unshard: list[int]  # gathered before the action (the next action's stage: a prefetch)
    reduce: list[int]  # reduce-scattered after the action
    reshard: list[int]  # resharded after the action


def sharding_plan(program: list[Action], zero3: bool, training: bool) -> list[Event]:
    """Per action of ``program``: the stages to gather before it, and to reduce and reshard after it.

    Before action k the stages of actions k and k + 1 are gathered (k + 1's
    is the prefetch). ZeRO-3 reshards a stage as soon as neither needs it;
    ZeRO-2 after the stage's last action. A stage is reduced after its last
    backward (``B``, or ``W`` in zero-bubble schedules) when ``training``.
    """
    last = {a.stage: k for k, a in enumerate(program)}
    last_backward = {a.stage: k for k, a in enumerate(program) if a.phase in (Phase.BACKWARD, Phase.WEIGHT)}
    events = [Event([], [], []) for _ in program]
    active: list[int] = []
    for k, action in enumerate(program):
        wanted = [action.stage] + [a.stage for a in program[k + 1:k + 2] if a.stage != action.stage]
        if zero3 and k:
            for s in [s for s in active if s not in wanted]:
                active.remove(s)
                events[k - 1].reshard.append(s)
        for s in wanted:
            if s not in active:
                active.append(s)
                events[k].unshard.append(s)
        if training and last_backward.get(action.stage) == k:
            events[k].reduce.append(action.stage)
        if last[action.stage] == k:
            active.remove(action.stage)
            events[k].reshard.append(action.stage)
    return events
