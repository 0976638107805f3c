"""Orders shaped by measured costs: each rank's program built from per-stage F, I, W and message times.

Every fixed schedule (1F1B, ZB-H1, ZB-V, interleaved, GPipe; torch's too) is
written for equal costs: F = I = W on every stage, messages free. On a real
model they are not (W can take twice an I; the first and the last stage carry
the embedding, the head and the loss), and the ranks wait. Given the costs of
each stage (:class:`~pipe.core.stage_costs.StageCosts`), :func:`schedule_from_costs` plays the pipeline out with a greedy
list scheduler under a memory limit (:mod:`pipe.core.greedy_order`), with a
few variants of its priority rule, for the looped placement (stage s on rank
``s % ranks``) and the V (rank r runs stages r and ``2 * ranks - 1 - r``),
and returns the order whose lowered programs (every step of each rank:
:mod:`pipe.core.lowering`) :func:`pipe.core.program_time.time_schedule` finds
fastest under the same costs. The fixed schedules of that placement are
candidates too, judged under the same costs and memory limit, so the result
is never slower in simulation than the best of them that fits. Where messages
cost time, each rank's receive posts are then chosen for the fastest orders
and the fixed ones (:func:`choose_posts`): a message's bytes move only once
its receive is posted, so a rank that posts one action ahead may wait for
bytes that could have moved during the action before.

The result is an ordinary :class:`~pipe.core.schedule_table.TableSchedule`:
validated, simulated, saved with ``to_csv`` and reloaded with ``from_csv``,
drawn with ``pipe-viz plan --table FILE.csv``, and run by
``DistributedPipe(model, chunks=M, schedule=table, balance=...)``. Usage::

    costs = StageCosts.of(forward=[1.2, 1.0], input_grad=[0.2, 1.0], weight_grad=[1.9, 2.1], transfer=0.05)
    table = schedule_from_costs(costs, ranks=2, microbatches=8)

:func:`pipe.plan.auto_schedule` measures the costs of a model's layers,
and the planner's search cuts it into stages and orders each cut with this module. The module imports no torch.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pipe.core.greedy_order import Rule, Stuck, greedy_programs, polish
from pipe.core.options import CHECKPOINT_MODES, checkpoint_stop
from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.schedule_table import TableSchedule
from pipe.core.stage_costs import StageCosts, lowered_step
from pipe.core.zero_bubble import v_rank_of

__all__: list[str] = []

logger = logging.getLogger(__name__)

PLACEMENTS = ("looped", "v", "best")
POST_CHOICES = (1, 2, 3, 4)  # actions ahead a rank may post its receives (0, just before the wait, is never faster)


@dataclass(frozen=True)
class JudgedOrder:
    """One order judged under the costs: its name, table, simulated step, weight held per rank, and the
    memory limit of its placement (:func:`schedule_from_costs`'s ``in_flight`` or ``memory_limit``)."""

    name: str
    schedule: TableSchedule
    step: float
    peak: tuple[float, ...]
    limit: float

    @property
    def fits(self) -> bool:
        return max(self.peak) <= self.limit + 1e-9


def _rank_of(placement: str, stages: int, ranks: int) -> list[int]:
    if placement == "v":
        if stages != 2 * ranks:
            raise ValueError(f"placement='v' runs 2 stages per rank: it needs {2 * ranks} stages for {ranks} ranks, "
                             f"got costs of {stages}; cut the model into {2 * ranks} stages or use placement='looped'")
        return [v_rank_of(s, ranks) for s in range(stages)]
    if stages % ranks:
        raise ValueError(f"placement='looped' runs the same number of stages on every rank: {stages} stages do not "
                         f"divide among {ranks} ranks; give costs of a multiple of {ranks} stages")
    return [s % ranks for s in range(stages)]


def _fixed(placement: str, stages: int, ranks: int, microbatches: int) -> list[Schedule]:
    """The fixed schedules of the placement, for these sizes."""
    if placement == "v":
        return [Schedule("zbv", ranks, microbatches)]
    per_rank = stages // ranks
    if per_rank == 1:
        return [Schedule(kind, ranks, microbatches) for kind in ("1f1b", "zb-h1", "gpipe")]
    kinds = ["looped-bfs"] + (["interleaved"] if microbatches % ranks == 0 else [])
    return [Schedule(kind, ranks, microbatches, virtual_stages=per_rank) for kind in kinds]


def _as_table(schedule: Schedule, name: str) -> TableSchedule:
    if isinstance(schedule, TableSchedule):
        return schedule
    return TableSchedule.from_table([schedule.actions(r) for r in range(schedule.ranks)], name=name)


def peak_held(schedule: Schedule, activation: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most weight (``activation`` per cell of each stage) held at once in program order:
    a cell from its F until its W (or B)."""
    peaks = []
    for rank in range(schedule.ranks):
        held = peak = 0.0
        for action in schedule.actions(rank):
            if action.phase is Phase.FORWARD:
                held += activation[action.stage]
                peak = max(peak, held)
            elif action.phase in (Phase.BACKWARD, Phase.WEIGHT):
                held -= activation[action.stage]
        peaks.append(peak)
    return tuple(peaks)


def choose_posts(schedule: TableSchedule, costs: StageCosts, checkpoint: str = "never"
                 ) -> tuple[TableSchedule, float]:
    """Where each rank posts its receives (:data:`POST_CHOICES` actions ahead), and the lowered step it gives.

    One rank at a time takes the horizon that shortens the lowered step most, till none does; a rank stays
    at the fewest actions ahead that is as fast (each posted receive holds its buffer till its wait).
    """
    stop = checkpoint_stop(checkpoint, schedule.microbatches)
    posts = [schedule.post_ahead(r) for r in range(schedule.ranks)]
    best = lowered_step(schedule.with_posts(posts), costs, stop)
    improved = True
    while improved:
        improved = False
        for rank in range(schedule.ranks):
            for ahead in POST_CHOICES:
                tried = posts[:rank] + [ahead] + posts[rank + 1:]
                step = lowered_step(schedule.with_posts(tried), costs, stop)
                if step < best * (1 - 1e-9) or (step <= best and ahead < posts[rank]):
                    posts, best, improved = tried, step, improved or step < best * (1 - 1e-9)
    return schedule.with_posts(posts), best


def fastest(found: Sequence[JudgedOrder], costs: StageCosts, checkpoint: str = "never", top: int = 4) -> JudgedOrder:
    """The fastest fitting candidate once each rank's receive posts are chosen (:func:`choose_posts`) for the
    ``top`` fastest and every fixed schedule, so that none of those is faster with its own posts. Without
    transfer costs posts change nothing: the fastest candidate as it is.

    Raises:
        ValueError: no candidate fits its memory limit.
    """
    ranked = sorted((c for c in found if c.fits), key=lambda c: c.step)
    if not ranked:
        raise ValueError("no candidate order fits its memory limit; raise in_flight or memory_limit")
    if not any(costs.transfer):
        return ranked[0]
    chosen = []
    for candidate in ranked[:top] + [c for c in ranked[top:] if not c.name.startswith("auto")]:
        table, step = choose_posts(candidate.schedule, costs, checkpoint)
        chosen.append(JudgedOrder(candidate.name, table, step, candidate.peak, candidate.limit))
    return min(chosen, key=lambda c: c.step)


def _rules(costs: StageCosts) -> list[Rule]:
    fused = any(b < i + w - 1e-12 for b, i, w in zip(costs.backward, costs.input_grad, costs.weight_grad))
    return [Rule(first, stage, fill, taper, split)
            for split in ((True, False) if fused else (True,))
            for first, stage, fill, taper in itertools.product(("I", "F"), ("late", "oldest"), ("always", "fits"),
                                                               (0.0, 1.0))]


def candidate_orders(costs: StageCosts, *, ranks: int, microbatches: int, placement: str = "best",
                     in_flight: Optional[float] = None, memory_limit: Optional[float] = None,
                     checkpoint: str = "never", budget: int = 100) -> list[JudgedOrder]:
    """Every order :func:`schedule_from_costs` weighs, fixed and greedy, each with its simulated step and
    peak (arguments as there); orders the greedy rule could not finish under the limit are left out.
    The fastest of each placement is then polished (:func:`pipe.core.greedy_order.polish`) with at most
    ``budget`` simulations."""
    given, placements = _check(costs, ranks, microbatches, placement, in_flight, memory_limit, checkpoint)
    found: list[JudgedOrder] = []
    seen: set[tuple[tuple[Action, ...], ...]] = set()

    def judge(name: str, schedule: Schedule) -> None:
        table = _as_table(schedule, name)
        if table.programs in seen:
            return
        seen.add(table.programs)
        found.append(JudgedOrder(name, table, lowered_step(table, costs, checkpoint_stop(checkpoint, microbatches)),
                               peak_held(table, costs.activation), limit))

    for where in placements:
        rank_of = _rank_of(where, costs.stages, ranks)
        # Default: 1F1B's peak on rank 0, `ranks` micro-batches of the rank's share of the model.
        limit = given if given is not None else ranks * max(
            sum(costs.activation[s] for s in range(costs.stages) if rank_of[s] == r) for r in range(ranks))
        for schedule in _fixed(where, costs.stages, ranks, microbatches):
            judge(schedule.kind, schedule)
        for rule in _rules(costs):
            try:
                programs = greedy_programs(ranks, microbatches, rank_of, costs.cost, costs.transfer, costs.activation,
                                           limit, rule, checkpoint != "never")
            except Stuck as stuck:
                logger.debug("%s", stuck)
                continue
            judge(f"auto {where} ({rule})", TableSchedule.from_table(programs, name="auto"))
        mine = [c for c in found if c.fits and c.schedule.placement == tuple(rank_of)]
        if mine and budget > 0:  # the fastest order of this placement, its neighbouring actions swapped
            start = min(mine, key=lambda c: c.step)
            shape = (ranks, microbatches, start.schedule.virtual_stages, tuple(rank_of))
            programs, step = polish([list(p) for p in start.schedule.programs],
                                    lambda p: _judged(p, shape, costs, checkpoint, limit), budget)
            if step is not None and step < start.step - 1e-12:
                judge(f"auto {where} ({start.name.partition('(')[2].rstrip(')') or start.name}, polished)",
                      TableSchedule.from_table(programs, name="auto"))
    return found


def _judged(programs: list[list[Action]], shape: tuple[int, int, int, tuple[int, ...]], costs: StageCosts,
            checkpoint: str, limit: float) -> Optional[float]:
    """The simulated step of ``programs`` (unchecked: :func:`polish` keeps each cell's order), None where they
    deadlock or hold more than ``limit``."""
    ranks, microbatches, per_rank, placement = shape
    table = TableSchedule("table", ranks, microbatches, per_rank,
                          tuple(tuple(program) for program in programs),
                          placement, "polish")
    if max(peak_held(table, costs.activation)) > limit + 1e-9:
        return None
    try:
        return lowered_step(table, costs, checkpoint_stop(checkpoint, microbatches))
    except RuntimeError:
        return None


def schedule_from_costs(costs: StageCosts, *, ranks: int, microbatches: int, placement: str = "best",
                        in_flight: Optional[float] = None, memory_limit: Optional[float] = None,
                        checkpoint: str = "never") -> TableSchedule:
    """The fastest order in simulation for ``costs`` that holds no more than the memory limit.

    Args:
        costs: each stage's costs (:class:`StageCosts`); the stages are the model's, in order.
        ranks: pipeline ranks; ``costs.stages`` must be a multiple of it (looped) or twice it (V).
        microbatches: micro-batches per step (``chunks``).
        placement: ``"looped"`` (stage s on rank ``s % ranks``), ``"v"`` (rank r runs stages r and
            ``2 * ranks - 1 - r``), or ``"best"``: every placement the stage count allows.
        in_flight: the most cells (micro-batch, stage pairs held from F to W) a rank may hold;
            default: 1F1B's peak on rank 0, ``ranks`` micro-batches of a rank's share of the stages
            (``ranks`` cells on one stage per rank, ``2 * ranks`` half-size cells in the V).
        memory_limit: instead of ``in_flight``, the most ``costs.activation`` (e.g. bytes) a rank holds;
            default as for ``in_flight``, weighed by ``costs.activation``.
        checkpoint: the ``DistributedPipe`` checkpoint mode the order will run under: ``"always"`` and
            ``"except_last"`` recompute each forward before its backward (costed as the forward again).

    Returns:
        A validated :class:`TableSchedule` named ``"auto"`` (or the fixed schedule's kind, where a fixed
        schedule is fastest); run it with ``DistributedPipe(..., chunks=microbatches, schedule=table)``.

    Raises:
        ValueError: a bad argument, or a memory limit no order fits (the message gives the least that works).
    """
    found = candidate_orders(costs, ranks=ranks, microbatches=microbatches, placement=placement, in_flight=in_flight,
                             memory_limit=memory_limit, checkpoint=checkpoint)
    fitting = [c for c in found if c.fits]
    if not fitting:
        least = min((max(c.peak) for c in found), default=math.inf)
        raise ValueError(f"no order of {costs.stages} stages on {ranks} ranks holds at most "
                         f"{found[0].limit if found else in_flight or memory_limit:g} per rank (in_flight / "
                         f"memory_limit); the least found holds {least:g}: raise the limit to {least:g}")
    best = fastest(fitting, costs, checkpoint)
    logger.debug("auto order: %s, simulated step %.6g (of %d candidates)", best.name, best.step, len(found))
    return best.schedule  # a fixed schedule's table is named by its kind (1f1b, zbv, ...)


def _check(costs: Any, ranks: Any, microbatches: Any, placement: Any, in_flight: Any, memory_limit: Any,
           checkpoint: Any) -> tuple[Optional[float], list[str]]:
    """The memory limit per rank given (None: the default) and the placements to try, after checking the arguments."""
    if not isinstance(costs, StageCosts):
        raise TypeError(f"costs must be a StageCosts (StageCosts.of(forward=..., input_grad=..., weight_grad=...)), "
                        f"got {type(costs).__name__}")
    for name, value in (("ranks", ranks), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if in_flight is not None and memory_limit is not None:
        raise ValueError("give in_flight (cells per rank) or memory_limit (costs.activation per rank), not both")
    if placement == "best":
        placements: list[str] = [p for p in ("looped", "v") if (p == "v" and costs.stages == 2 * ranks)
                      or (p == "looped" and costs.stages % ranks == 0)]
        if not placements:
            _rank_of("looped", costs.stages, ranks)  # raises with the fix
    else:
        placements = [placement]
        _rank_of(placement, costs.stages, ranks)
    for name, value in (("in_flight", in_flight), ("memory_limit", memory_limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if memory_limit is not None:
        return float(memory_limit), placements
    if in_flight is not None and any(a != 1.0 for a in costs.activation):
        raise ValueError("in_flight counts cells; with costs.activation given, pass memory_limit in its unit")
    return (float(in_flight) if in_flight is not None else None), placements
