"""The greedy list scheduler behind :mod:`pipe.core.cost_order`: one rank's next action by a priority rule.

The zero-bubble paper builds its order from profiled costs by playing the
pipeline out in time (sail-sg's ``zerobubble/scheduler/zb.py``); this is our
own take on that idea. The clock is event-driven: the rank that is free
first picks, among the actions whose input has arrived by then,

* the input gradient I (or the whole backward B) of its oldest waiting
  micro-batch: the stage before waits for it, so it is on the critical path;
* a forward F, if the rank's memory allows another cell (a (micro-batch,
  stage) pair held from its F until its W), keeping room for one cell of
  each of its later stages so a micro-batch that entered can always leave;
* a weight gradient W, which nobody waits for, to fill the time until
  something else is ready (and to free memory);

and otherwise waits for the earliest input to arrive. :class:`Rule` varies
the priorities (I or F first, which stage's F first, whether a W may delay
an input that arrives while it runs, a memory limit tapered by rank, I and
W apart or fused as B), and :mod:`pipe.core.cost_order` keeps the variant
the simulator finds fastest, and :func:`polish` then swaps neighbouring
actions of that order while the simulated step gets shorter. The module
imports no torch.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from pipe.core.action import Action, Phase

__all__: list[str] = []

F, I, W, B = Phase.FORWARD, Phase.INPUT, Phase.WEIGHT, Phase.BACKWARD


@dataclass(frozen=True)
class Rule:
    """One variant of the priority rule.

    Attributes:
        first: ``"I"``: an arrived gradient goes before a ready forward; ``"F"``: the forward goes first.
        stage: which of the rank's stages' forwards goes first: ``"late"`` (nearest the loss),
            ``"early"``, or ``"oldest"`` (the oldest micro-batch, later stage on ties).
        fill: ``"always"``: a pending W runs whenever nothing else is ready; ``"fits"``: only if it ends
            before the next input known to arrive (else the rank waits for it).
        taper: the memory limit of rank r is ``limit - taper * r`` cells (at least enough for one
            micro-batch), as 1F1B holds fewer micro-batches on later ranks.
        split: I and W apart; False: one B per backward (W right after its I).
    """

    first: str = "I"
    stage: str = "late"
    fill: str = "always"
    taper: float = 0.0
    split: bool = True

    def __str__(self) -> str:
        return (f"{self.first}-first, {self.stage} stage, W {self.fill}" + (f", taper {self.taper:g}" if self.taper else "")
                + ("" if self.split else ", fused B"))


class Stuck(RuntimeError):
    """The rule left every rank waiting (a memory limit too small for this placement)."""


def greedy_programs(
    ranks: int, microbatches: int, rank_of: Sequence[int], cost: Callable[[Phase, int], float],
    transfer: Sequence[float], weights: Sequence[float], limit: float, rule: Rule, recompute: bool,
) -> list[list[Action]]:
    """Each rank's program, built by playing the pipeline out with ``rule`` (see the module docstring).

    Args:
        ranks, microbatches: the pipeline's size.
        rank_of: the rank of each stage.
        cost: seconds of ``(phase, stage)``, phases F, I, W and B.
        transfer: seconds of the message across each stage boundary (``stages - 1`` entries).
        weights, limit: each stage's cell weight and the most weight a rank holds.
        rule: the priorities.
        recompute: whether each I (or B) is preceded by a recompute of the forward, which needs no input.

    Raises:
        Stuck: every rank waits for another (the memory limit is too small).
    """
    stages = len(rank_of)
    last = stages - 1
    mine = [[s for s in range(stages) if rank_of[s] == r] for r in range(ranks)]
    later = [max([weights[t] for t in mine[rank_of[s]] if t > s], default=0.0) for s in range(stages)]
    least = [sum(weights[s] for s in mine[r]) for r in range(ranks)]  # one micro-batch through every stage
    limits = [max(limit - rule.taper * r, least[r]) for r in range(ranks)]
    back = I if rule.split else B
    ends: dict[Action, float] = {}
    free = [0.0] * ranks
    held = [0.0] * ranks
    next_f, next_i = [0] * stages, [0] * stages
    weights_due: list[collections.deque[tuple[int, int]]] = [collections.deque() for _ in range(ranks)]
    programs: list[list[Action]] = [[] for _ in range(ranks)]
    left = [len(mine[r]) * microbatches * (3 if rule.split else 2) for r in range(ranks)]
    waiting: set[int] = set()

    def arrival(action: Action, boundary: int, here: int) -> float | None:
        """When the input ``action`` produced reaches rank ``here`` (None: not yet scheduled)."""
        end = ends.get(action)
        if end is None:
            return None
        remote = 0 <= boundary < len(transfer) and rank_of[action.stage] != here
        return end + (transfer[boundary] if remote else 0.0)

    def run(rank: int, action: Action, start: float) -> None:
        phase, i, s = action.phase, action.microbatch, action.stage
        if phase is F:
            held[rank] += weights[s]
            next_f[s] += 1
        elif phase in (I, B):
            next_i[s] += 1
            if phase is I:
                weights_due[rank].append((i, s))
            else:
                held[rank] -= weights[s]
        else:
            held[rank] -= weights[s]
        redo = cost(F, s) if recompute and phase in (I, B) else 0.0
        ends[action] = free[rank] = max(start, free[rank] + redo) + cost(phase, s)
        programs[rank].append(action)
        left[rank] -= 1
        waiting.clear()

    while any(left):
        active = [r for r in range(ranks) if left[r] and r not in waiting]
        if not active:
            stuck = [f"rank {r}: {programs[r][-1] if programs[r] else 'nothing run'}" for r in range(ranks) if left[r]]
            raise Stuck(f"rule {rule} leaves every rank waiting ({'; '.join(stuck)})")
        rank = min(active, key=lambda r: (free[r], r))
        now = free[rank]
        inputs: list[tuple[float, int, int, int]] = []  # (ready, micro-batch, -stage, 0) for I/B
        forwards: list[tuple[float, int, int]] = []  # (ready, micro-batch, stage)
        for s in mine[rank]:
            i = next_i[s]
            if i < next_f[s]:
                ready = arrival(Action(F, i, s), -1, rank) if s == last else arrival(Action(back, i, s + 1), s, rank)
                if ready is not None:
                    inputs.append((ready, i, -s, 0))
            i = next_f[s]
            if i < microbatches and held[rank] + weights[s] + later[s] <= limits[rank] + 1e-9:
                ready = 0.0 if s == 0 else arrival(Action(F, i, s - 1), s - 1, rank)
                if ready is not None:
                    forwards.append((ready, i, s))
        redo = {s: cost(F, s) if recompute else 0.0 for s in mine[rank]}
        ready_i = [x for x in inputs if x[0] <= now + redo[-x[2]] + 1e-12]
        ready_f = [x for x in forwards if x[0] <= now + 1e-12]
        chosen: Action | None = None
        pick_i = min(ready_i, key=lambda x: (x[1], x[2])) if ready_i else None
        if rule.stage == "late":
            pick_f = min(ready_f, key=lambda x: (-x[2], x[1])) if ready_f else None
        elif rule.stage == "early":
            pick_f = min(ready_f, key=lambda x: (x[2], x[1])) if ready_f else None
        else:
            pick_f = min(ready_f, key=lambda x: (x[1], -x[2])) if ready_f else None
        if pick_i is not None and (rule.first == "I" or pick_f is None):
            chosen = Action(back, pick_i[1], -pick_i[2])
        elif pick_f is not None:
            chosen = Action(F, pick_f[1], pick_f[2])
        if chosen is not None:
            run(rank, chosen, now)
            continue
        upcoming = min([x[0] for x in inputs] + [x[0] for x in forwards], default=math.inf)
        if weights_due[rank]:
            i, s = weights_due[rank][0]
            if rule.fill == "always" or now + cost(W, s) <= upcoming + 1e-12 or upcoming == math.inf:
                weights_due[rank].popleft()
                run(rank, Action(W, i, s), now)
                continue
        ahead = min([free[r] for r in range(ranks) if r != rank and left[r] and free[r] > now], default=math.inf)
        wake = min(upcoming, ahead)
        if wake == math.inf:
            waiting.add(rank)  # woken when any rank runs something
        else:
            free[rank] = wake
    return programs


def polish(programs: list[list[Action]], evaluate: Callable[[list[list[Action]]], float | None], budget: int
           ) -> tuple[list[list[Action]], float | None]:
    """Swaps neighbouring actions of one rank while the step gets shorter: first improvement, at most ``budget``
    evaluations. ``evaluate`` gives a program's step, or None where it cannot run or holds too much.

    Two actions of the same cell (its F, I and W) keep their order, and so do the micro-batches of one phase on
    one stage; a swap that deadlocks or breaks the memory limit is for ``evaluate`` to refuse.
    """
    best = evaluate(programs)
    if best is None:
        return programs, None
    current = [list(p) for p in programs]
    improved = True
    while improved and budget > 0:
        improved = False
        for rank, program in enumerate(current):
            for k in range(len(program) - 1):
                a, b = program[k], program[k + 1]
                if (a.microbatch, a.stage) == (b.microbatch, b.stage) or (a.phase, a.stage) == (b.phase, b.stage) \
                        or budget <= 0:
                    continue
                program[k], program[k + 1] = b, a
                budget -= 1
                step = evaluate(current)
                if step is not None and step < best - 1e-12:
                    best, improved = step, True
                else:
                    program[k], program[k + 1] = a, b
    return current, best
