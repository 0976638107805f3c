"""Pipeline schedules as data: the ordered program of every rank.

The thread runner, the process runner (one stage per rank under torchrun) and
the visualiser must agree on the order in which micro-batches move through the
stages. Writing that order once, as a table of actions per rank, and deriving
the clock cycles, the simulated timeline, the bubble and the activation memory
from the same table keeps them in step. The module imports no torch, and
``import pipe.core.schedule`` loads none (``pipe``'s top-level names load on
first use), so the tables can be built, checked and drawn anywhere.

Example:
    >>> s = Schedule("1f1b", ranks=2, microbatches=4)
    >>> [str(a) for a in s.actions(0)]
    ['F0@0', 'F1@0', 'B0@0', 'F2@0', 'B1@0', 'F3@0', 'B2@0', 'B3@0']
    >>> round(s.bubble_fraction(), 3)
    0.2
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipe.core.action import Action, Phase
from pipe.core.zero_bubble import ZERO_BUBBLE_KINDS, v_rank_of, v_stages_of, zero_bubble_programs

__all__: list[str] = []

SCHEDULE_KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv")


def _one_forward_one_backward(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    """Warm-up forwards, then one forward / one backward pairs, then cool-down backwards."""
    program = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        program += [forwards[warmup + k], backwards[k]]
    program += backwards[len(forwards) - warmup :]
    return program


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: which rank runs which forward and backward, in which order.

    GPipe (fill-drain), 3 ranks, 4 micro-batches, forward = backward = 1; one
    column per clock cycle, ``Fi``/``Bi`` is micro-batch i on the rank's stage::

        rank 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
        rank 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
        rank 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

    1F1B (PipeDream-flush), same sizes: rank r runs ``ranks - r - 1`` warm-up
    forwards, then alternates, so it holds at most ``ranks - r`` micro-batches::

        rank 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        rank 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        rank 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

    Interleaved 1F1B (Megatron's virtual pipeline) gives each rank
    ``virtual_stages`` model chunks; stage s runs on rank ``s % ranks``.

    Looped BFS (``"looped-bfs"``, Lamy-Poirier 2022, torch's ``ScheduleLoopedBFS``)
    places stages as interleaved does but runs breadth first: every forward of
    the rank's first stage, then of its next, ...; then the backwards, last
    stage first, micro-batches in reverse. Each stage runs in one forward run
    and one backward run, so an FSDP-sharded stage is gathered at most twice a step.

    The zero-bubble schedules ``"zb-h1"`` and ``"zbv"`` (Qi et al., ICLR 2024)
    split each backward into I (input gradient, sent upstream) and W (weight
    gradient, deferred into what would be bubble); ``"zbv"`` runs two stages
    per rank in a V (rank r: stages r and ``2 * ranks - 1 - r``). Their
    orderings are in :mod:`pipe.core.zero_bubble`.

    Args:
        kind: one of ``SCHEDULE_KINDS``.
        ranks: workers (threads or processes) that execute the stages.
        microbatches: micro-batches per mini-batch (M).
        virtual_stages: stages per rank; 1 unless ``kind`` is ``"interleaved"`` or ``"looped-bfs"``;
            ``"zbv"`` always has 2 (1, the default, is read as 2).

    Raises:
        ValueError: a field is out of range; the message names the value and the fix.
    """

    kind: str
    ranks: int
    microbatches: int
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            expected = ", ".join(repr(k) for k in SCHEDULE_KINDS)
            raise ValueError(f"unknown schedule kind {self.kind!r}; expected one of {expected}")
        self._check_sizes()
        if self.kind == "zbv" and self.virtual_stages in (1, 2):
            object.__setattr__(self, "virtual_stages", 2)  # the V: two stages per rank
        elif self.kind == "zbv":
            raise ValueError(
                f"virtual_stages={self.virtual_stages} does not fit kind='zbv', which runs two stages "
                f"per rank in a V; use virtual_stages=2 (or leave it out), or kind='interleaved'"
            )
        elif self.kind not in ("interleaved", "looped-bfs") and self.virtual_stages != 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs kind='interleaved' or 'looped-bfs'; "
                f"{self.kind!r} runs one stage per rank (use virtual_stages=1)"
            )
        if self.kind == "interleaved" and self.microbatches % self.ranks != 0:
            lower = self.microbatches // self.ranks * self.ranks or self.ranks
            upper = lower + self.ranks
            raise ValueError(
                f"interleaved schedule needs microbatches divisible by ranks "
                f"(got microbatches={self.microbatches}, ranks={self.ranks}); "
                f"use a multiple of {self.ranks}, such as {lower} or {upper}"
            )

    def _check_sizes(self) -> None:
        """Ranks, micro-batches and stages per rank are positive ints (every schedule's, tables' too)."""
        for name in ("ranks", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} must be a positive integer (got {value!r}); pass an int >= 1"
                )

    @property
    def stages(self) -> int:
        """Model stages in the pipeline: ``ranks * virtual_stages``."""
        return self.ranks * self.virtual_stages

    @property
    def splits_backward(self) -> bool:
        """Whether backwards run as I then W (zero-bubble kinds) rather than one B."""
        return self.kind in ZERO_BUBBLE_KINDS

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``: stage s on rank ``s % ranks`` (loop placement),
        or in a V for ``"zbv"`` (stages r and ``2 * ranks - 1 - r`` on rank r)."""
        if not 0 <= stage < self.stages:
            raise ValueError(
                f"stage {stage} is out of range for a schedule with {self.stages} stages; "
                f"expected 0 <= stage < {self.stages}"
            )
        if self.kind == "zbv":
            return v_rank_of(stage, self.ranks)
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages that ``rank`` runs, in model order."""
        self._check_rank(rank)
        if self.kind == "zbv":
            return v_stages_of(rank, self.ranks)
        return [chunk * self.ranks + rank for chunk in range(self.virtual_stages)]

    def actions(self, rank: int) -> list[Action]:
        """The ordered program of forwards and backwards that ``rank`` executes.

        Example:
            >>> [str(a) for a in Schedule("gpipe", 2, 3).actions(1)]
            ['F0@1', 'F1@1', 'F2@1', 'B2@1', 'B1@1', 'B0@1']
        """
        self._check_rank(rank)
        m = self.microbatches
        if self.splits_backward:
            return list(zero_bubble_programs(self.kind, self.ranks, m)[rank])
        if self.kind == "gpipe":
            # Fill, then drain; backward in reverse micro-batch order, as autograd runs it.
            return [Action(Phase.FORWARD, i, rank) for i in range(m)] + [
                Action(Phase.BACKWARD, i, rank) for i in reversed(range(m))
            ]
        if self.kind == "looped-bfs":
            mine = self.stages_of(rank)
            return [Action(Phase.FORWARD, i, s) for s in mine for i in range(m)] + [
                Action(Phase.BACKWARD, i, s) for s in reversed(mine) for i in reversed(range(m))]
        if self.kind == "1f1b":
            forwards = [Action(Phase.FORWARD, i, rank) for i in range(m)]
            backwards = [Action(Phase.BACKWARD, i, rank) for i in range(m)]
            return _one_forward_one_backward(forwards, backwards, min(self.ranks - rank - 1, m))
        # Interleaved, after Megatron-LM: micro-batches go in groups of `ranks`
        # through chunk 0, then the same group through chunk 1, ...; backward
        # visits the chunks in reverse. Warm-up fills every chunk of the ranks below.
        total = m * self.virtual_stages
        warmup = (self.ranks - rank - 1) * 2 + (self.virtual_stages - 1) * self.ranks
        forwards = [self._interleaved(Phase.FORWARD, k, rank) for k in range(total)]
        backwards = [self._interleaved(Phase.BACKWARD, k, rank) for k in range(total)]
        return _one_forward_one_backward(forwards, backwards, min(warmup, total))

    def _interleaved(self, phase: Phase, k: int, rank: int) -> Action:
        """The k-th forward or backward of ``rank`` in the interleaved schedule."""
        group, position = divmod(k, self.ranks * self.virtual_stages)
        chunk = position // self.ranks
        if phase is Phase.BACKWARD:
            chunk = self.virtual_stages - 1 - chunk
        microbatch = group * self.ranks + position % self.ranks
        return Action(phase, microbatch, chunk * self.ranks + rank)

    def post_ahead(self, rank: int) -> int:
        """Actions ahead ``rank`` posts its receives (:func:`pipe.core.lowering.lower`); tables choose per rank."""
        self._check_rank(rank)
        return 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ranks:
            raise ValueError(
                f"rank {rank} is out of range for a schedule with {self.ranks} ranks; "
                f"expected 0 <= rank < {self.ranks}"
            )

    def _dependency(self, action: Action) -> Action | None:
        """The action on another stage whose result ``action`` consumes, if any."""
        i, s = action.microbatch, action.stage
        if action.phase is Phase.FORWARD:
            return Action(Phase.FORWARD, i, s - 1) if s > 0 else None
        if action.phase is Phase.WEIGHT:
            return Action(Phase.INPUT, i, s)  # the graph that I kept
        if s == self.stages - 1:
            return Action(Phase.FORWARD, i, s)  # the loss turns the last forward around
        return Action(action.phase, i, s + 1)  # B after B, I after I

    def forward_clock_cycles(self) -> list[list[Action]]:
        """The forwards grouped into clock cycles, for the thread runner.

        A clock cycle holds the forwards that start together when every phase
        takes one unit of time, ordered by micro-batch; cycles without a forward
        are left out. For GPipe, cycle k holds F(i, j) for every i + j == k::

            cycle   0       1             2             3
                    F0@0    F0@1 F1@0     F1@1 F2@0     F2@1      (2 ranks, 3 micro-batches)
        """
        from pipe.core.program_time import phase_durations, time_schedule  # it times what this module defines

        cycles: dict[float, list[Action]] = {}
        for timed in time_schedule(self, phase_durations(forward=1.0, backward=1.0)):
            if timed.action.phase is Phase.FORWARD:
                cycles.setdefault(timed.start, []).append(timed.action)
        return [
            sorted(cycles[start], key=lambda a: (a.microbatch, a.stage)) for start in sorted(cycles)
        ]

    def bubble_fraction(
        self, forward: float = 1.0, backward: float = 2.0, recompute: float = 0.0, *,
        input_grad: float | None = None, weight_grad: float | None = None,
    ) -> float:
        """The idle share of the simulated timeline: 1 - busy / (ranks * makespan).

        For GPipe and 1F1B this is (ranks - 1) / (microbatches + ranks - 1).
        For ZB-H1 with F = I = W (backward = 2 * forward) and microbatches >=
        ranks, each rank idles ``(ranks - 1) * (F + I - W)``, a third of 1F1B's; see
        :mod:`pipe.core.zero_bubble`. Arguments as for :func:`pipe.core.program_time.phase_durations`;
        every micro-batch recomputes when ``recompute > 0``.
        """
        from pipe.core.program_time import phase_durations, time_schedule  # it times what this module defines

        durations = phase_durations(forward, backward, recompute, input_grad=input_grad, weight_grad=weight_grad)
        timeline = time_schedule(self, durations, checkpoint_stop=self.microbatches if recompute > 0 else 0)
        busy = math.fsum(t.duration for t in timeline)
        makespan = max(t.end for t in timeline)
        return 1.0 - busy / (self.ranks * makespan)

    def peak_inflight(self) -> list[int]:
        """Per rank, the most micro-batches holding activations at once.

        Counts (micro-batch, stage) pairs whose forward has run and whose
        backward (or, split, whose W) has not, in program order; with one stage
        per rank these are micro-batches. 1F1B holds ``min(ranks - rank,
        microbatches)``, GPipe all, ZB-H1 ``min(ranks, microbatches)`` on every
        rank (1F1B's peak, which rank 0 has), ZB-V at most ``2 * ranks`` half stages.
        """
        peaks = []
        for rank in range(self.ranks):
            held: set[tuple[int, int]] = set()
            peak = 0
            for action in self.actions(rank):
                key = (action.microbatch, action.stage)
                if action.phase is Phase.FORWARD:
                    held.add(key)
                    peak = max(peak, len(held))
                elif action.phase in (Phase.BACKWARD, Phase.WEIGHT):
                    held.discard(key)
            peaks.append(peak)
        return peaks

    def validate(self) -> None:
        """Check the tables: each (micro-batch, stage) has exactly one forward and
        one backward (zero-bubble: one I and one W), on the rank that owns the
        stage, forward first (then I, then W); 1F1B keeps at most ``ranks -
        rank`` micro-batches in flight, ZB-H1 at most ``ranks``, ZB-V ``2 *
        ranks`` half stages; the ranks never wait forever
        (:func:`check_programs`).

        Raises:
            ValueError: naming the first violation found.
        """
        check_programs(self)


def check_programs(schedule: Schedule) -> None:
    """Checks that ``schedule``'s programs can run, naming the first action that breaks them.

    Each (micro-batch, stage) has one F and one B (or one I and one W), on the
    rank that owns the stage, F first (then I, then W); nothing is missing; the
    built-in kinds keep their in-flight bounds; and the ranks do not wait
    forever: an action waiting for one its own rank runs later can never run,
    and ranks waiting for each other deadlock.

    Raises:
        ValueError: naming the first violation found.
    """
    programs = [schedule.actions(rank) for rank in range(schedule.ranks)]
    # The schedule's own classes (pipe.core.schedule loaded as a file, without the package, has its own).
    sample = next((a for program in programs for a in program), None)
    A: Any = type(sample) if sample is not None else Action
    P: Any = type(sample.phase) if sample is not None else Phase
    phases = (P("F"), P("I"), P("W")) if schedule.splits_backward else (P("F"), P("B"))
    seen: dict[Action, int] = {}
    for rank, program in enumerate(programs):
        position: dict[Action, int] = {}
        for index, action in enumerate(program):
            if action.phase not in phases:
                raise ValueError(
                    f"{schedule}: rank {rank} has {action}; programs hold only "
                    + ("forwards, input and weight gradients (a B runs as I and W)" if schedule.splits_backward
                       else "forwards and backwards"))
            if not 0 <= action.stage < schedule.stages or schedule.rank_of(action.stage) != rank:
                owner = f"rank {schedule.rank_of(action.stage)}" if 0 <= action.stage < schedule.stages \
                    else f"no rank (the schedule has {schedule.stages} stages)"
                raise ValueError(f"{schedule}: {action} is on rank {rank} but stage {action.stage} belongs to {owner}")
            if action in seen:
                raise ValueError(f"{schedule}: {action} appears more than once")
            seen[action] = rank
            position[action] = index
        for action, index in position.items():
            if action.phase is not P("F"):
                twin = A(phases[phases.index(action.phase) - 1], action.microbatch, action.stage)
                if twin not in position and twin not in seen:
                    raise ValueError(f"{schedule}: {twin} is missing (rank {rank} runs {action})")
                if position.get(twin, len(program)) > index:
                    raise ValueError(f"{schedule}: rank {rank} runs {action} before {twin}")
    for rank, program in enumerate(programs):  # in program order: the first action left without its W
        for action in program:
            if action.phase is P("I") and A(P("W"), action.microbatch, action.stage) not in seen:
                raise ValueError(f"{schedule}: rank {rank} runs {action} but never its W "
                                 f"(W{action.microbatch}@{action.stage}): its weight gradient would be lost")
    for stage in range(schedule.stages):
        for i in range(schedule.microbatches):
            for phase in phases:
                if A(phase, i, stage) not in seen:
                    raise ValueError(f"{schedule}: {A(phase, i, stage)} is missing")
    if len(seen) != len(phases) * schedule.stages * schedule.microbatches:
        extra = sorted(str(a) for a in seen if a.microbatch not in range(schedule.microbatches))
        raise ValueError(f"{schedule}: actions for unknown micro-batches: {', '.join(extra)}")
    bounds = {"1f1b": ("1F1B", "ranks - rank", lambda r: schedule.ranks - r),
              "zb-h1": ("ZB-H1", "ranks", lambda r: schedule.ranks),
              "zbv": ("ZB-V", "2 * ranks", lambda r: 2 * schedule.ranks)}
    if schedule.kind in bounds:
        name, formula, bound = bounds[schedule.kind]
        for rank, peak in enumerate(schedule.peak_inflight()):
            if peak > bound(rank):
                raise ValueError(f"{schedule}: rank {rank} holds {peak} micro-batches in flight; "
                                 f"{name} allows at most {formula} = {bound(rank)}")
    from pipe.core.program_time import time_schedule  # it times what this module defines

    try:
        time_schedule(schedule)
    except RuntimeError:
        raise ValueError(_stuck(schedule, programs)) from None


def _stuck(schedule: Schedule, programs: list[list[Action]]) -> str:
    """Why the simulation stopped: the first stuck action, and whether its wait can never end or is a deadlock."""
    done: set[Action] = set()
    cursor = [0] * schedule.ranks
    moved = True
    while moved:  # run every rank as far as it goes, with unit durations
        moved = False
        for rank, program in enumerate(programs):
            while cursor[rank] < len(program):
                needed = schedule._dependency(program[cursor[rank]])
                if needed is not None and needed not in done:
                    break
                done.add(program[cursor[rank]])
                cursor[rank] += 1
                moved = True
    waits = [(rank, programs[rank][cursor[rank]]) for rank in range(schedule.ranks) if cursor[rank] < len(programs[rank])]
    for rank, action in waits:
        needed = schedule._dependency(action)
        assert needed is not None
        if schedule.rank_of(needed.stage) == rank:
            return (f"{schedule}: rank {rank} runs {action} before {needed}, which it waits for: "
                    "this dependency can never be met (move it after)")
    described = "; ".join(f"rank {rank} at {action} (waits for {schedule._dependency(action)})"
                          for rank, action in waits)
    return f"{schedule} deadlocks: {described}: the ranks wait for each other, first at {waits[0][1]}"
