"""The planner's search: the fastest plan predicted to fit a memory budget on every rank (no torch).

Usage::

    plan = search(costs, 4, "2GiB")           # costs measured by pipe.plan.profile_costs, or tabled
    text = plan.table()                       # chosen, runners-up, and why faster plans were rejected
    model = Pipe(model, **plan.pipe_kwargs()) # chunks, balance, checkpoint

:func:`search` takes the candidates of :mod:`pipe.plan.candidates` (schedule,
micro-batch count, balance, checkpoint mode, virtual stages, per-stage
recompute, full or selective), visits them best-first by a lower bound of their step, and keeps
the fastest whose predicted peak (:func:`pipe.plan.predict.predict`) fits
every rank's budget; :func:`pipe.plan.plan` (:mod:`pipe.plan.planning`, the
driver) first measures the costs of a model (:func:`pipe.plan.profile.profile_costs`).
"""
from __future__ import annotations

import heapq
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from pipe.core.units import format_bytes, parse_bytes
from pipe.plan.candidates import BUILT_ORDERS, RUNNERS, candidates, per_stage_offload, per_stage_recompute
from pipe.core.options import REDUCES, UNITS
from pipe.plan.cost import Costs
from pipe.plan.candidate import AUTO_KINDS, Candidate
from pipe.plan.predict import Prediction, busy_bound, predict, predict_memory
from pipe.plan.sharding import DpShard, split_candidates, split_summary, split_text
from pipe.plan.timing import TimeModel

__all__: list[str] = []

logger = logging.getLogger(__name__)


Budget = Union[int, float, str, Sequence[Union[int, float, str]]]

CHUNKS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""The micro-batch counts :func:`pipe.plan.plan` profiles and considers by default."""


NO_BUDGET = sys.maxsize
"""The budget of each rank when ``search`` is given none: any plan fits."""

class PlanError(ValueError):
    """No candidate fits the memory budget; the message names the smallest budget that does."""


@dataclass
class Plan:
    """The chosen plan, with what it was chosen over.

    Attributes:
        best: the fastest candidate predicted to fit.
        runners_up: the next fastest that fit, each with why it lost ("slower by +4.2%").
        rejected: candidates faster than ``best``, each with why it does not fit (the rank, its stages, the bytes).
        budget: bytes per rank (:data:`NO_BUDGET` each where none was given).
        runner: ``"threads"`` (``Pipe``) or ``"processes"`` (``DistributedPipe``).
        considered: how many candidates were compared (memory predicted for all).
        simulated: how many of them had their step time simulated (the others could not win).
        model: the time model used (None: layer times alone).
        splits: with ``dp_shard=`` or ``dp_replicate=``, one line per ``pp x dp_replicate x dp_shard``
            split and ZeRO mode: chosen, or why it lost (and the splits left out, with the reason);
            ``split_axes`` names the mesh dimensions planned (``"pp x dp_shard"``).
        calibration: with ``plan(calibrate=True)``, the plans run to fit ``model`` and their times.
    """

    best: Prediction
    runners_up: list[tuple[Prediction, str]]
    rejected: list[tuple[Prediction, str]]
    budget: list[int]
    runner: str
    considered: int
    costs: Optional[Costs] = field(default=None, repr=False)
    simulated: int = 0
    model: Optional[TimeModel] = None
    splits: list[str] = field(default_factory=list)
    calibration: Optional[Any] = None  # a pipe.plan.Calibration (the driver's), with plan(calibrate=True)
    split_axes: str = "pp x dp_shard"

    @property
    def candidate(self) -> Candidate:
        return self.best.candidate

    def pipe_kwargs(self) -> dict[str, Any]:
        """Arguments of ``Pipe(model, **kwargs)`` (add ``devices=``); GPipe plans only.

        Raises:
            ValueError: the plan needs another schedule, which only ``DistributedPipe`` runs.
        """
        c = self.candidate
        if c.schedule != "gpipe":
            raise ValueError(f"the plan uses schedule={c.schedule!r}, which Pipe does not run; use "
                             f"DistributedPipe(model, **plan.distributed_kwargs()), or plan with runner='threads'")
        kwargs: dict[str, Any] = {"chunks": c.chunks, "balance": list(c.balance), "checkpoint": c.checkpoint}
        if c.recompute_config() is not None:
            kwargs["recompute"] = c.recompute_config()
        return kwargs

    def distributed_kwargs(self) -> dict[str, Any]:
        """Arguments of ``DistributedPipe(model, **kwargs)`` (:meth:`Candidate.distributed_kwargs`); a sharded
        or replicated plan needs ``mesh=make_mesh(**plan.mesh_kwargs())`` too (built under torch.distributed, on
        every rank)."""
        kwargs = self.candidate.distributed_kwargs()
        if self.candidate.schedule in AUTO_KINDS:  # the order built from the plan's costs, a TableSchedule
            kwargs["schedule"] = self.best.schedule
        return kwargs

    def mesh_kwargs(self) -> dict[str, int]:
        """Arguments of ``pipe.distributed.make_mesh(**kwargs)`` for the plan's ``pp x dp_replicate x dp_shard`` split
        (:meth:`Candidate.mesh_kwargs`)."""
        return self.candidate.mesh_kwargs()

    def table(self, rejected: int = 8) -> str:
        """The chosen plan with its predicted step and peak per rank, the runners-up and why they lost,
        and the ``rejected`` fastest plans over budget with the rank over it."""
        sizes = [format_bytes(b) for b in self.budget]
        budget = "no memory budget" if set(self.budget) == {NO_BUDGET} else \
            f"memory budget {sizes[0]} per rank" if len(set(sizes)) == 1 else \
            f"memory budget {', '.join(sizes)} on ranks 0 to {len(sizes) - 1}"
        lines = [f"{budget}; {self.considered} candidates, {self.simulated} simulated ({self.runner})"]
        if self.model is not None:
            lines.append(f"time model: {self.model.describe()}")
        if self.costs is not None and self.costs.host_copy is not None:
            lines.append(f"offload planned: {self.costs.host_copy.describe()}")
        if self.calibration is not None:
            lines.append(self.calibration.describe())
        peaks = "peak per pipeline rank" if self.splits else "peak per rank"  # each of its data-parallel ranks alike
        lines.append(f"{'':2}{'plan':<64} {'step':>10} {peaks:>30}")

        def row(mark: str, p: Prediction, why: str = "") -> str:
            peaks = " ".join(format_bytes(b) for b in p.peaks)
            split = f" {split_text(p.candidate)}" if self.splits and p.candidate.parts == 1 else ""
            return f"{mark:2}{p.candidate.describe() + split:<64} {p.step_time * 1e3:>8.2f}ms {peaks:>30}" + (
                f"  {why}" if why else "")

        lines.append(row("*", self.best, "chosen"))
        if self.splits:
            lines.append(f"splits of the ranks ({self.split_axes}):")
            lines += [f"  {line}" for line in self.splits]
        if self.runners_up:
            lines.append("next best that fit:")
            lines += [row("", p, why) for p, why in self.runners_up]
        if self.rejected:
            shown = self.rejected[:rejected]
            lines.append(f"faster, but over budget ({len(self.rejected)}"
                         + (f", the {len(shown)} fastest shown):" if len(shown) < len(self.rejected) else "):"))
            lines += [row("x", p, why) for p, why in shown]
        return "\n".join(lines)


def search(costs: Costs, ranks: int, memory_budget: Optional[Budget] = None, *, runner: str = "threads",
           schedules: Optional[Sequence[str]] = None, checkpoints: Sequence[str] = ("never", "except_last", "always"),
           max_balances: int = 64, balances: Optional[Sequence[Sequence[int]]] = None,
           runners_up: int = 4, model: Optional[TimeModel] = None, per_stage: bool = True,
           rejected: int = 8, dp_shard: DpShard = None, zero: Sequence[int] = (3, 2),
           dp_replicate: DpShard = None, units: Sequence[str] = UNITS, reduces: Sequence[str] = REDUCES) -> Plan:
    """The fastest candidate whose predicted peak fits ``memory_budget`` on every rank (the fastest of all
    without one).

    Candidates go best-first by a lower bound of their step
    (:func:`pipe.plan.predict.busy_bound`: the busiest rank's work, no
    waiting); each one's memory is walked (its ranks' programs), and its time
    simulated if it fits, or if it is one of the ``rejected`` fastest plans
    over the budget. A plan over budget with checkpoint "never" adds its
    per-stage recompute variant (:func:`per_stage_recompute`) to the queue.
    The search stops once the bound exceeds the ``runners_up + 1`` fastest
    fitting plans found, so most candidates are never simulated.

    Args:
        costs: measured (:func:`pipe.plan.profile.profile_costs`) or tabled costs.
        ranks: devices (``Pipe`` partitions or ``DistributedPipe`` pipeline ranks).
        memory_budget: bytes per rank (``"2GiB"``, a number, or one per rank); None: no budget, every
            candidate fits (:func:`pipe.plan.auto_schedule` plans so).
        runner: ``"threads"`` (``Pipe``: GPipe) or ``"processes"`` (``DistributedPipe``).
        schedules: only these schedules. Default (None): the fixed schedules the runner runs, and for
            ``"processes"`` also each rank's order built from the stage costs (``"auto"``, ``"auto-v"``:
            :func:`pipe.schedule_from_costs`) where the ranks are one pipeline (no ``dp_shard``/``dp_replicate``),
            built only for a cut whose bound is below the fastest plan found so far (so never slower than
            :func:`pipe.plan.auto_schedule`'s plan); naming ``"auto"`` or ``"auto-v"`` builds it for every cut
            visited, runners-up and sharded splits included (slower: one order search each).
        checkpoints: restrict the candidates.
        max_balances: enumerate every balance up to this many, else a neighbourhood
            of the even, time- and memory-balanced ones.
        balances: consider only these balances (one entry per stage).
        model: the time model (:class:`pipe.plan.timing.TimeModel`).
        per_stage: also plan per-stage recompute (:func:`per_stage_recompute`) and offload
            (:func:`per_stage_offload`, on a CUDA device's costs).
        rejected: how many plans over budget to simulate and show.
        dp_shard: plan ``ranks`` as ``pp x dp_shard`` (:mod:`pipe.plan.sharding`): ``"auto"``
            every divisor of ``ranks``, or the sizes to try (1: no sharding); each pipeline then
            runs on B / dp_shard samples, from the profiled micro-batch sizes (chunks c at
            dp_shard S needs the profile of chunks S*c). None (default): every rank a pipeline rank.
        zero: with ``dp_shard``, the ZeRO stages to compare: 3 (``Shard(reshard_after_forward=True)``), 2.
        units, reduces: with ``dp_shard`` under ZeRO-3, what FSDP gathers at a time (``Shard(unit=...)``):
            ``"stage"`` (a stage whole per run of its actions), ``"block"`` (a layer at a time), and for
            ``"block"`` when gradients are reduce-scattered (``Shard(reduce=...)``): ``"step"``, or
            ``"micro-batch"`` (least memory, most traffic). Default: all of them.
        dp_replicate: plan ``ranks`` with full replicas of each pipeline too, as ``dp_shard``
            (``"auto"`` or sizes): ``pp x dp_replicate`` (the runner's gradient averager), or with
            ``dp_shard`` ``pp x dp_replicate x dp_shard`` (HSDP); each pipeline on B / (dp_replicate x
            dp_shard) samples.

    Raises:
        PlanError: nothing fits; the message names the smallest peak, the rank and stages holding it.
    """
    budget = _budget(memory_budget, ranks)
    skipped: list[str] = []
    to_win: tuple[str, ...] = ()  # kinds whose order is built only where it may win (the loop below)
    if dp_shard is None and dp_replicate is None:
        # By default the built orders are candidates of a pipeline without replicas or shards, where the bound
        # is the busiest rank's whole work; with them it leaves the collectives out (they follow the order).
        to_win = BUILT_ORDERS.get(runner, ()) if schedules is None else ()
        kinds = list(schedules) if schedules is not None else list(RUNNERS.get(runner, ())) + list(to_win)
        options = candidates(costs, ranks, runner, schedules=kinds, checkpoints=checkpoints,
                             max_balances=max_balances, balances=balances)
    else:
        if len(set(budget)) > 1:
            raise ValueError(f"memory_budget gives {len(budget)} different sizes, one per rank, but with dp_shard= "
                             f"or dp_replicate= the ranks' roles depend on the split; give one size for every rank")
        options, skipped = split_candidates(costs, ranks, runner, dp_shard, zero, dp_replicate, units, reduces,
                                            schedules=schedules,
                                            checkpoints=checkpoints, max_balances=max_balances, balances=balances)
    if not options:
        raise ValueError(f"no candidate plan: the balances {balances} do not split {costs.layers} layers "
                         f"into {ranks} stages (or 2 x {ranks} for interleaved and zbv)")
    memory: dict[Candidate, tuple[list[int], list[int]]] = {}

    def fits(c: Candidate) -> bool:
        if c not in memory:
            memory[c] = predict_memory(costs, c, runner=runner, model=model)
        return all(peak <= b for peak, b in zip(memory[c][0], budget))

    # Best-first by a lower bound of the step: memory is walked, and time simulated, only for
    # candidates that may still be among the fastest; a plan over budget spawns its per-stage variant.
    bounds = {c: busy_bound(costs, c, model) for c in options}
    queue = [(bounds[c], k, c) for k, c in enumerate(options) if c.schedule not in to_win]
    heapq.heapify(queue)
    predictions: list[Prediction] = []
    fitting: list[float] = []
    considered, over = len(options), 0
    while queue:
        bound, _, c = heapq.heappop(queue)
        if len(fitting) > runners_up and bound > sorted(fitting)[runners_up]:
            break
        ok = fits(c)
        if not ok and per_stage and c.checkpoint == "never" and not c.recompute and not c.offload:
            for marked in (per_stage_recompute(costs, c, budget, runner), per_stage_offload(costs, c, budget, runner)):
                if marked is not None:
                    considered += 1
                    heapq.heappush(queue, (busy_bound(costs, marked, model), considered, marked))
        if not ok and (over >= max(rejected, 1) or (fitting and bound > min(fitting))):
            continue  # over budget, and enough such plans shown (or slower than a plan that fits)
        p = predict(costs, c, runner=runner, timeline=False, model=model, memory=memory[c])
        predictions.append(p)
        if ok:
            fitting.append(p.step_time)
        else:
            over += 1
    # Then the orders built from the costs, by bound, each only while it may beat the fastest plan that fits:
    # an order is a greedy search, far dearer than a fixed schedule's prediction.
    for c in sorted((c for c in options if c.schedule in to_win), key=bounds.__getitem__):
        if fitting and bounds[c] >= min(fitting):
            break
        if fits(c):
            predictions.append(predict(costs, c, runner=runner, timeline=False, model=model, memory=memory[c]))
            fitting.append(predictions[-1].step_time)
    if not fitting:
        walked = [c for c in options if c.schedule not in to_win]  # walking a built order first builds it
        for c in walked:
            fits(c)
        raise PlanError(_nothing_fits(costs, walked, memory, budget))
    predictions.sort(key=lambda p: (p.step_time, p.peak))
    fit = [p for p in predictions if fits(p.candidate)]
    if fit[0].candidate.schedule in AUTO_KINDS:  # within rounding of a fixed schedule (often the same order)
        same = [p for p in fit if p.candidate.schedule not in AUTO_KINDS and p.peak <= fit[0].peak
                and p.step_time <= fit[0].step_time * (1 + 1e-9)]
        if same:
            fit.remove(same[0])
            fit.insert(0, same[0])
    best = fit[0]
    rejected_ = [(p, _why(p, budget, best)) for p in predictions[:predictions.index(best)] if not fits(p.candidate)]
    ups = [(p, f"slower by {p.step_time / best.step_time - 1:+.1%}") for p in fit[1:1 + runners_up]]
    splits = [] if dp_shard is None and dp_replicate is None else split_summary(predictions, bounds, fits, best, budget[0]) + [
        f"left out: {why}" for why in skipped]
    axes = " x ".join(["pp"] + [name for name, sizes in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard))
                                if sizes is not None])
    chosen = Plan(predict(costs, best.candidate, runner=runner, model=model), ups, rejected_, budget, runner,
                  considered, costs, simulated=len(predictions), model=model, splits=splits, split_axes=axes)
    logger.info("planned %s: predicted step %.3f ms, peaks %s (%d candidates, %d walked, %d simulated)",
                best.candidate.describe(), best.step_time * 1e3, [format_bytes(b) for b in best.peaks],
                considered, len(memory), len(predictions))
    return chosen


def _nothing_fits(costs: Costs, options: list[Candidate], memory: dict[Candidate, tuple[list[int], list[int]]],
                  budget: list[int]) -> str:
    smallest = min(options, key=lambda c: max(peak - b for peak, b in zip(memory[c][0], budget)))
    peaks = memory[smallest][0]
    rank = max(range(len(peaks)), key=lambda r: peaks[r] - budget[r])
    need = peaks[rank]
    return (f"no plan fits memory_budget={', '.join(sorted({format_bytes(b) for b in budget}))} per rank: "
            f"the smallest predicted peak is {format_bytes(need)} ({need} bytes) on {_rank_text(smallest)} {rank} "
            f"({_stages_text(smallest, rank)}; {format_bytes(memory[smallest][1][rank])} of it parameters, "
            f"gradients and optimiser state), reached by {smallest.describe()}; raise memory_budget to at least "
            f"{format_bytes(need)} or plan over more stages")


def _rank_text(candidate: Candidate) -> str:
    """"rank", or for a sharded or replicated plan "pipeline rank" (each of its data-parallel ranks holds the
    same)."""
    return "pipeline rank" if candidate.parts > 1 else "rank"


def _stages_text(candidate: Candidate, rank: int) -> str:
    schedule = candidate.layout()
    parts = []
    for s in schedule.stages_of(rank):
        first = sum(candidate.balance[:s])
        parts.append(f"stage {s}: layers {first}-{first + candidate.balance[s] - 1}")
    return ", ".join(parts)


def _why(prediction: Prediction, budget: list[int], best: Prediction) -> str:
    over = [(r, peak, b) for r, (peak, b) in enumerate(zip(prediction.peaks, budget)) if peak > b]
    faster = f"{1 - prediction.step_time / best.step_time:.1%} faster, but " if best.step_time else ""
    return faster + "; ".join(f"{_rank_text(prediction.candidate)} {r} ({_stages_text(prediction.candidate, r)}) "
                              f"needs {format_bytes(peak)} > "
                              f"{format_bytes(b)}" for r, peak, b in over)


def _budget(memory_budget: Optional[Budget], ranks: int) -> list[int]:
    if memory_budget is None:
        return [NO_BUDGET] * ranks
    if isinstance(memory_budget, (list, tuple)):
        if len(memory_budget) != ranks:
            raise ValueError(f"memory_budget has {len(memory_budget)} entries for {ranks} ranks; "
                             f"give one size, or one per rank")
        return [parse_bytes(b) for b in memory_budget]
    return [parse_bytes(memory_budget)] * ranks  # type: ignore[arg-type]
