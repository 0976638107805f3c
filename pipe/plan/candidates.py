"""The candidates the planner compares: schedules, micro-batch counts, balances, checkpoint modes, and
per-stage recompute (:func:`per_stage_recompute`) or offload (:func:`per_stage_offload`) where a budget
needs it."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence, TypeVar

from pipe.balance.solver import cut_for_ranks, solve
from pipe.core.options import CHECKPOINT_MODES, checkpoint_stop
from pipe.core.schedule import Schedule
from pipe.core.zero_bubble import ZERO_BUBBLE_KINDS, v_rank_of
from pipe.plan.cost import Costs
from pipe.plan.candidate import AUTO_KINDS, Candidate
from pipe.plan.predict import predict_memory
from pipe.plan.sharding import replica_costs

__all__: list[str] = []

#: Which front end runs the plan: threads (``Pipe``, GPipe) or processes (``DistributedPipe``), and the
#: schedules it plans by default.
RUNNERS: dict[str, tuple[str, ...]] = {"threads": ("gpipe",),
                                       "processes": ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")}
#: Schedules whose orders are built from a candidate's own stage costs (:func:`pipe.schedule_from_costs`, a
#: greedy search per candidate): ``"auto"`` and ``"auto-v"``. By default :func:`pipe.plan.search` builds one
#: only for a cut that may beat the fastest plan found; ``schedules=`` naming them plans them for every cut.
BUILT_ORDERS: dict[str, tuple[str, ...]] = {"threads": (), "processes": AUTO_KINDS}

#: Stages per rank each schedule is planned with (1 where not listed).
VIRTUAL_STAGES: dict[str, tuple[int, ...]] = {"interleaved": (2,), "zbv": (2,), "auto": (1, 2), "auto-v": (2,)}


def _compositions(layers: int, parts: int) -> Iterable[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _balances(costs: Costs, parts: int, limit: int, rank_of: Sequence[int], ranks: int) -> list[tuple[int, ...]]:
    """Every balance when there are at most ``limit``; else even, by time, by memory and by the busiest
    rank's time (stage s on rank ``rank_of[s]``: :func:`pipe.balance.solver.cut_for_ranks`), and their
    neighbours (one layer moved across one cut)."""
    if math.comb(costs.layers - 1, parts - 1) <= limit:
        return list(_compositions(costs.layers, parts))
    rows = max(costs.forward)
    time = [f + b for f, b in zip(costs.forward[rows], costs.backward[rows])]
    chunks = costs.batch // rows
    memory = [float(costs.stage_memory(k, k + 1, chunks, False).kept + costs.static_bytes(k, k + 1))
              for k in range(costs.layers)]
    base, extra = divmod(costs.layers, parts)
    seeds = {tuple(base + (1 if k < extra else 0) for k in range(parts)),
             tuple(solve(time, parts)), tuple(solve(memory, parts)),
             *(tuple(cut) for cut in cut_for_ranks(time, parts, rank_of, ranks))}
    found = set(seeds)
    for seed in seeds:
        for cut in range(parts - 1):
            for delta in (-1, 1):
                moved = list(seed)
                moved[cut] += delta
                moved[cut + 1] -= delta
                if min(moved) >= 1:
                    found.add(tuple(moved))
    return sorted(found)


def candidates(costs: Costs, ranks: int, runner: str = "threads", *, schedules: Optional[Sequence[str]] = None,
               checkpoints: Sequence[str] = ("never", "except_last", "always"), max_balances: int = 64,
               balances: Optional[Sequence[Sequence[int]]] = None) -> list[Candidate]:
    """The plans :func:`search` compares with one checkpoint mode for every stage (``balances``: only these,
    for the schedules with as many stages); :func:`search` adds per-stage recompute where the budget needs it."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {sorted(RUNNERS)}, got {runner!r} "
                         f"('threads' plans for Pipe, 'processes' for DistributedPipe)")
    kinds = tuple(schedules) if schedules is not None else RUNNERS[runner]
    unknown = [k for k in kinds if k not in RUNNERS[runner] + BUILT_ORDERS[runner]]
    if unknown:
        raise ValueError(f"schedules {unknown} cannot run with runner={runner!r}; "
                         f"choose from {list(RUNNERS[runner] + BUILT_ORDERS[runner])}")
    bad = [c for c in checkpoints if c not in CHECKPOINT_MODES]
    if bad:
        raise ValueError(f"unknown checkpoint modes {bad}; choose from {list(CHECKPOINT_MODES)}")
    if not 1 <= ranks <= costs.layers:
        raise ValueError(f"cannot split {costs.layers} layers over {ranks} stages; stages must be "
                         f"between 1 and {costs.layers}")
    found = []
    for kind, virtual in [(k, v) for k in kinds for v in VIRTUAL_STAGES.get(k, (1,))]:
        if ranks * virtual > costs.layers or (virtual > 1 and kind != "zbv" and kind != "auto-v" and ranks == 1):
            continue  # two stages on one rank are one stage, except in a V
        if balances is not None:
            options = [tuple(b) for b in balances if len(b) == ranks * virtual and sum(b) == costs.layers]
        else:
            v = kind in ("zbv", "auto-v")
            options = _balances(costs, ranks * virtual, max_balances,
                                [v_rank_of(s, ranks) if v else s % ranks for s in range(ranks * virtual)], ranks)
        for balance in options:
            for chunks in costs.chunk_options():
                if kind == "interleaved" and chunks % ranks:
                    continue
                stops = set()
                for checkpoint in checkpoints:  # modes that checkpoint the same micro-batches are one plan
                    if checkpoint_stop(checkpoint, chunks) not in stops:
                        stops.add(checkpoint_stop(checkpoint, chunks))
                        found.append(Candidate(kind, chunks, balance, checkpoint, virtual))
    return found


def per_stage_recompute(costs: Costs, candidate: Candidate, budget: list[int], runner: str = "threads"
                        ) -> Optional[Candidate]:
    """``candidate`` (checkpoint "never") with the cheapest recompute marks per stage that fit ``budget``.

    A rank's peak depends only on its own stages' marks, and marking one more
    layer never makes a step faster, so each rank is settled on its own: its
    stages take one more mark at a time, where it saves the most bytes per
    second of replay, until the rank fits (AdaPipe's per-stage choice, without
    simulating the combinations). A mark is full recompute of the stage's next
    layer (:func:`pipe.recompute.recompute`) or, where the costs measured it
    (``Costs.select``), selective recompute of it (the chosen operations only,
    :func:`pipe.recompute.select_recompute`), later raised to full where that
    pays. None when marking every layer does not fit, or the plan already fits
    without marks.
    Zero-bubble schedules are left out: a layer's mark would replay it in I and again in W; so are plans
    that offload (:func:`per_stage_offload`): a layer recomputes or offloads.
    """
    if candidate.checkpoint != "never" or candidate.schedule in (*ZERO_BUBBLE_KINDS, *AUTO_KINDS) or any(candidate.offload):
        return None
    schedule = candidate.layout()
    view = replica_costs(costs, candidate.parts)  # each pipeline's share of the batch
    rows = view.rows(candidate.chunks)
    peaks, _ = predict_memory(costs, candidate, runner=runner)
    if all(p <= b for p, b in zip(peaks, budget)):
        return None
    first_of = [sum(candidate.balance[:s]) for s in range(len(candidate.balance))]

    def replay(layer: int, selective: bool) -> float:  # seconds a mark adds per micro-batch
        table = view.select_replay if selective else view.replay
        return table[rows][layer] if table is not None else math.inf

    def marked(f: list[int], g: list[int]) -> Candidate:
        if all(b <= a for a, b in zip(f, g)):  # every selective mark raised to full: none left
            return replace(candidate, recompute=tuple(f))
        return replace(candidate, recompute=tuple(f), select=tuple(g), select_names=costs.select)

    def peak_of(marks: tuple[list[int], list[int]], rank: int) -> int:
        return predict_memory(costs, marked(*marks), runner=runner, ranks=[rank])[0][rank]

    def options(marks: tuple[list[int], list[int]], s: int) -> Iterable[tuple[tuple[list[int], list[int]], float, bool]]:
        full, select = marks
        f, g = full[s], select[s]
        if f < candidate.balance[s]:  # layer f recomputes fully (if it was selective, that replay goes); a full
            # mark may save nothing itself yet open the next layer's
            yield (([*full[:s], f + 1, *full[s + 1:]], [*select[:s], max(g, f + 1), *select[s + 1:]]),
                   replay(first_of[s] + f, False) - (replay(first_of[s] + f, True) if g > f else 0.0), True)
        if costs.select and g < candidate.balance[s]:  # layer g recomputes selectively
            yield (full, [*select[:s], g + 1, *select[s + 1:]]), replay(first_of[s] + g, True), False

    none = [0] * len(candidate.balance)
    settled = _settle_ranks(schedule, peaks, budget, candidate.chunks, (none, none), options, peak_of)
    return marked(*settled) if settled is not None else None


def per_stage_offload(costs: Costs, candidate: Candidate, budget: list[int], runner: str = "threads"
                      ) -> Optional[Candidate]:
    """``candidate`` (checkpoint "never", no marks) with the fewest seconds of host copies per stage that
    fit ``budget``: each over-budget rank's stages offload one more of their first layers at a time
    (:func:`pipe.recompute.offload`, prefetched one layer ahead), where it saves the most bytes per
    second the copies add beyond what its compute hides (:meth:`pipe.plan.cost.Costs.stage_costs`).

    None when the costs measured no host copy (the CPU: offloading saves nothing there), for the
    zero-bubble schedules (not planned), for FSDP gathering a layer at a time (not planned together), when
    offloading every layer does not fit, or when the plan already fits without it.
    """
    if (not costs.offloads or candidate.checkpoint != "never" or candidate.recompute or candidate.selective()
            or candidate.schedule in (*ZERO_BUBBLE_KINDS, *AUTO_KINDS) or candidate.blocks):
        return None
    schedule = candidate.layout()
    peaks, _ = predict_memory(costs, candidate, runner=runner)
    if all(p <= b for p, b in zip(peaks, budget)):
        return None
    view = replica_costs(costs, candidate.parts)  # each pipeline's share of the batch
    bounds = [(sum(candidate.balance[:s]), sum(candidate.balance[:s + 1])) for s in range(len(candidate.balance))]

    def seconds(s: int, offloaded: int) -> float:  # one micro-batch's forward and backward on stage s
        t = view.stage_costs([bounds[s]], candidate.chunks, offloaded=[offloaded])
        return t.forward[0] + t.backward[0]

    def peak_of(counts: list[int], rank: int) -> int:
        return predict_memory(costs, replace(candidate, offload=tuple(counts)), runner=runner, ranks=[rank])[0][rank]

    def options(counts: list[int], s: int) -> Iterable[tuple[list[int], float, bool]]:
        if counts[s] < candidate.balance[s]:  # the next layer may save nothing itself (a view of the caller's
            more = [*counts[:s], counts[s] + 1, *counts[s + 1:]]  # batch) yet open the next one's
            yield more, seconds(s, more[s]) - seconds(s, counts[s]), True

    settled = _settle_ranks(schedule, peaks, budget, candidate.chunks, [0] * len(candidate.balance), options, peak_of)
    return replace(candidate, offload=tuple(settled)) if settled is not None else None


State = TypeVar("State")


def _settle_ranks(schedule: Schedule, peaks: list[int], budget: list[int], chunks: int, state: State,
                  options: Callable[[State, int], Iterable[tuple[State, float, bool]]],
                  peak_of: Callable[[State, int], int]) -> Optional[State]:
    """Settles each rank over budget on its own, greedily: one move at a time on one of its stages
    (``options(state, stage)``: the next states, the seconds each adds per micro-batch, and whether it may
    open a later move), the one saving the most bytes per second added, until the rank fits; where no
    move lowers the rank's peak (``peak_of(state, rank)``), the cheapest that opens a later one. None when
    a rank's moves run out before it fits.
    """
    for rank in range(schedule.ranks):
        peak = peaks[rank]
        while peak > budget[rank]:
            best: Optional[tuple[float, State, int]] = None
            unlock: Optional[tuple[float, State, int]] = None
            for s in schedule.stages_of(rank):
                for new, seconds, opens in options(state, s):
                    if math.isinf(seconds):
                        continue
                    new_peak = peak_of(new, rank)
                    score = (peak - new_peak) / max(seconds * chunks, 1e-12)
                    if new_peak < peak and (best is None or score > best[0]):
                        best = (score, new, new_peak)
                    elif new_peak >= peak and opens and (unlock is None or seconds < unlock[0]):
                        unlock = (seconds, new, new_peak)
            chosen = best or unlock
            if chosen is None:
                return None  # every layer of the rank marked, still over
            _, state, peak = chosen
    return state
