"""Zero-bubble orderings: the programs of ZB-H1 and ZB-V, each backward split in I and W.

Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024) splits a backward
into the input gradient (I: the previous stage waits for it) and the weight
gradient (W: nobody waits for it). Only I stays on the critical path, and W
fills what would be bubble. A (micro-batch, stage) cell holds its activations
(or the recomputed ones) from its F until its W.

ZB-H1 (one stage per rank) is 1F1B whose W's are deferred: rank r runs the
1F1B warm-up (``ranks - r - 1`` forwards), then ``F I`` pairs, and from the
``r + 1``-th pair on each pair is followed by the oldest W. Every rank then
holds at most ``ranks`` cells, 1F1B's peak (rank 0's). With W no longer than
F and I, and at least ``ranks`` micro-batches, each rank idles
``(ranks - 1) * (F + I - W)`` (the paper's formula), against 1F1B's
``(ranks - 1) * (F + I + W)``: a third when F = I = W. 4 ranks, 6 micro-batches::

    rank 0 | F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5
    rank 1 | .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5
    rank 2 | .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5
    rank 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5

ZB-V (two stages per rank in a V: rank r holds stages r and 2p-1-r, so the
first and the last stage share rank 0 and the loss turns around in place) has
two orders, and each step size gets the one that ends first on a reference
clock (below). The *pattern* is the handcrafted V of the paper (torch's
``ScheduleZBVZeroBubble`` runs the same order). Rank r, with its stage on the
way down d = r and on the way up u = 2p-1-r:

1. ``2(p - r) - 1`` forwards of d;
2. r times: F of u, F of d;
3. ``p - r`` times: F, I, W of u;
4. steady state, until every forward has run: F of d (while it has any left),
   I and W of d, then F, I and W of u;
5. r times: I of d, I of u; then ``p - r`` times: I of d and the oldest W of
   d; then the W's left, u's before d's.

It is written for ``max(M, 2p - 1)`` micro-batches, the fewest that fill the
V, and the actions of micro-batches past M are left out. Each I is followed
by its W in the steady state, so a rank holds at most ``2p`` cells (half a
stage each: 1F1B's peak of ``p`` stages).

With few micro-batches the V never fills (it takes ``2p - 1``), and the
*rule of thumb* can do better: played out on a unit-time clock (F = I = W = 1
per stage, transfers free), a free rank runs

1. an I whose gradient has arrived (oldest micro-batch first, it unblocks
   the previous stage),
2. else an F whose input has arrived, if the rank holds fewer than ``2p``
   cells,
3. else the oldest pending W,

and otherwise waits. The reference clock gives every phase one unit, except
on the first stage, whose input needs no gradient: its I does nothing and
its W the whole backward (0 and 2 units), as on every real model. There the
pattern ends first once there are a few more micro-batches than ranks (on
2 ranks from 4, on 4 ranks from 6, on 8 ranks from 10), and the rule of thumb
below that. With F = I = W everywhere and at least ``2p - 1`` micro-batches,
the chosen order idles ``p - 1`` phase-lengths per rank on 1 to 8 ranks
(half of ZB-H1's time). Measured on 2 ranks with 4 micro-batches, the
pattern's steps were 7-8% shorter than the rule of thumb's without
checkpointing and level with it, and its ranks held less
(docs/benchmarks.md). The result is a fixed table: the runners execute it
whatever the real durations, and
:func:`pipe.core.program_time.time_schedule` replays it with any durations.
The module imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pipe.core.action import Action, Phase
from pipe.core.program_time import time_schedule

__all__: list[str] = []

#: Schedule kinds whose backward is split in I and W.
ZERO_BUBBLE_KINDS: tuple[str, ...] = ("zb-h1", "zbv")

_F, _I, _W = Phase.FORWARD, Phase.INPUT, Phase.WEIGHT


def v_rank_of(stage: int, ranks: int) -> int:
    """V placement: stage s runs on rank s going down, then on rank ``2 * ranks - 1 - s`` coming back."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


def v_stages_of(rank: int, ranks: int) -> list[int]:
    """The two stages of ``rank`` in the V, in model order: ``rank`` and ``2 * ranks - 1 - rank``."""
    return [rank, 2 * ranks - 1 - rank]


@lru_cache(maxsize=256)
def zero_bubble_programs(kind: str, ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """The program of every rank for a zero-bubble ``kind``.

    Args:
        kind: ``"zb-h1"`` (stage r on rank r) or ``"zbv"`` (stages r and 2p-1-r on rank r).
        ranks: pipeline ranks (p).
        microbatches: micro-batches per step (M).

    Returns:
        One tuple of actions per rank, phases F, I and W.

    Raises:
        ValueError: ``kind`` is not a zero-bubble kind.
    """
    if kind == "zb-h1":
        return tuple(_zb_h1(rank, ranks, microbatches) for rank in range(ranks))
    if kind == "zbv":
        return _faster_v(ranks, microbatches)
    raise ValueError(f"{kind!r} is not a zero-bubble schedule; expected one of {ZERO_BUBBLE_KINDS}")


def _zb_h1(rank: int, ranks: int, microbatches: int) -> tuple[Action, ...]:
    """1F1B with each rank's W's deferred by ``rank`` pairs (see the module docstring)."""
    m = microbatches
    warmup = min(ranks - rank - 1, m)
    program = [Action(_F, i, rank) for i in range(warmup)]
    weights = 0
    for k in range(m):
        if warmup + k < m:
            program.append(Action(_F, warmup + k, rank))
        program.append(Action(_I, k, rank))
        if k >= rank or warmup + k >= m:  # steady state past the deferral, or cool-down
            program.append(Action(_W, weights, rank))
            weights += 1
    program += [Action(_W, i, rank) for i in range(weights, m)]
    return tuple(program)


@dataclass(frozen=True)
class _Programs:
    """Programs as :func:`pipe.core.program_time.time_schedule` times them, before they are a schedule."""

    programs: tuple[tuple[Action, ...], ...]
    stages: int

    @property
    def ranks(self) -> int:
        return len(self.programs)

    def actions(self, rank: int) -> tuple[Action, ...]:
        return self.programs[rank]

    def post_ahead(self, rank: int) -> int:
        return 1


def _faster_v(ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-V's programs by the pattern or by the rule of thumb, whichever ends first on the reference clock.

    The reference clock gives every phase of every stage one unit, except the
    first stage's: its input needs no gradient, so its I does nothing and its
    W does the whole backward (0 and 2 units). On a tie the rule of thumb is
    kept: it idles less on a clock of equal phases where the V cannot fill.
    """
    def makespan(programs: tuple[tuple[Action, ...], ...]) -> float:
        timed = time_schedule(_Programs(programs, 2 * ranks), lambda action: (
            {_I: 0.0, _W: 2.0}.get(action.phase, 1.0) if action.stage == 0 else 1.0))
        return max(t.end for t in timed)

    pattern = tuple(_v_pattern(rank, ranks, microbatches) for rank in range(ranks))
    rule = _v_rule(ranks, microbatches)
    return pattern if makespan(pattern) < makespan(rule) else rule


def _v_pattern(rank: int, ranks: int, microbatches: int) -> tuple[Action, ...]:
    """ZB-V's program on ``rank`` by the pattern of the module docstring.

    The pattern is written for ``max(M, 2p - 1)`` micro-batches, the fewest
    that fill the V; the actions of micro-batches past M are then left out,
    which keeps every dependency (a left-out action only ever waits for
    left-out ones).
    """
    down, up = v_stages_of(rank, ranks)
    filled = max(microbatches, 2 * ranks - 1)
    program: list[Action] = []
    count = {(phase, stage): 0 for phase in (_F, _I, _W) for stage in (down, up)}

    def run(phase: Phase, stage: int) -> None:
        program.append(Action(phase, count[phase, stage], stage))
        count[phase, stage] += 1

    for _ in range(2 * (ranks - rank) - 1):  # 1. fill the way down
        run(_F, down)
    for _ in range(rank):  # 2. the way up starts
        run(_F, up)
        run(_F, down)
    for _ in range(ranks - rank):  # 3. the first gradients turn around
        for phase in (_F, _I, _W):
            run(phase, up)
    while count[_F, down] < filled or count[_F, up] < count[_F, down]:  # 4. steady: F I W on each stage
        if count[_F, down] < filled:
            run(_F, down)
        run(_I, down)
        run(_W, down)
        for phase in (_F, _I, _W):
            run(phase, up)
    for _ in range(rank):  # 5. drain: input gradients first, their W's later
        run(_I, down)
        run(_I, up)
    for _ in range(ranks - rank):
        run(_I, down)
        run(_W, down)
    for stage in (up, down):
        while count[_W, stage] < count[_I, stage]:
            run(_W, stage)
    return tuple(action for action in program if action.microbatch < microbatches)


def _v_rule(ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-V by the rule of thumb (see the module docstring), played out on a unit-time clock."""
    m, last = microbatches, 2 * ranks - 1
    limit = 2 * ranks
    owned = [v_stages_of(r, ranks) for r in range(ranks)]
    ends: dict[Action, int] = {}  # what has run, and when it ended
    programs: list[list[Action]] = [[] for _ in range(ranks)]
    held = [0] * ranks
    weights: list[list[Action]] = [[] for _ in range(ranks)]  # pending W's, oldest first
    forwards = [dict.fromkeys(stages, 0) for stages in owned]  # per stage: the next micro-batch
    inputs = [dict.fromkeys(stages, 0) for stages in owned]
    total, now = 3 * 2 * ranks * m, 0  # F, I and W of every (micro-batch, stage)

    def arrived(action: Action) -> bool:
        return ends.get(action, now + 1) <= now

    while len(ends) < total:
        for rank in range(ranks):
            if programs[rank] and ends[programs[rank][-1]] > now:
                continue  # busy
            choice: Action | None = None
            ready = [(i, -s) for s, i in inputs[rank].items() if i < min(m, forwards[rank][s])
                     and arrived(Action(_F, i, last) if s == last else Action(_I, i, s + 1))]
            if ready:
                i, s = min(ready)
                choice = Action(_I, i, -s)
                weights[rank].append(Action(_W, i, -s))
            if choice is None and held[rank] < limit:
                ready = [(i, -s) for s, i in forwards[rank].items() if i < m and (s == 0 or arrived(Action(_F, i, s - 1)))]
                if ready:
                    i, s = min(ready)
                    choice = Action(_F, i, -s)
                    held[rank] += 1
            if choice is None and weights[rank]:
                choice = weights[rank].pop(0)
                held[rank] -= 1
            if choice is None:
                continue
            if choice.phase is _F:
                forwards[rank][choice.stage] += 1
            elif choice.phase is _I:
                inputs[rank][choice.stage] += 1
            programs[rank].append(choice)
            ends[choice] = now + 1
        now += 1
        if now > 4 * total:  # every step of the clock runs something somewhere; cannot happen
            raise RuntimeError(f"zbv with {ranks} ranks and {m} micro-batches does not finish")
    return tuple(tuple(program) for program in programs)
