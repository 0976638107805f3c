"""The planner: the fastest plan predicted to fit a memory budget on every rank.

Usage::

    import pipe.plan
    plan = pipe.plan.plan(model, sample, memory_budget="2GiB", stages=4)
    print(plan.table())                       # chosen, runners-up, and why faster plans were rejected
    model = Pipe(model, **plan.pipe_kwargs()) # chunks, balance, checkpoint

:func:`search` enumerates candidates (schedule, micro-batch count, balance,
checkpoint mode, virtual stages), predicts each one with
:func:`pipe.plan.predict.predict`, and keeps the fastest whose predicted peak
fits every rank's budget; :func:`plan` first measures the costs of a model
(:func:`pipe.plan.cost.profile_costs`).
"""
from __future__ import annotations

import itertools
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from pipe.balance.solver import solve
from pipe.core.options import CHECKPOINT_MODES, checkpoint_stop
from pipe.core.partition import verify_module
from pipe.plan.cost import Costs, profile_costs
from pipe.plan.predict import Candidate, Prediction, predict

__all__ = ["Plan", "PlanError", "RUNNERS", "format_bytes", "parse_bytes", "plan", "search"]

logger = logging.getLogger(__name__)

#: Which front end runs the plan: threads (``Pipe``, GPipe) or processes (``DistributedPipe``).
RUNNERS: dict[str, tuple[str, ...]] = {"threads": ("gpipe",), "processes": ("gpipe", "1f1b", "interleaved")}

Budget = Union[int, float, str, Sequence[Union[int, float, str]]]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """No candidate fits the memory budget; the message names the smallest budget that does."""


def parse_bytes(value: Union[int, float, str]) -> int:
    """Bytes from ``2GiB``, ``512MB``, ``1.5e9`` or a number.

    Raises:
        ValueError: not a positive size; the message shows the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory budget must be a size such as '2GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot read memory budget {value!r}; write a number of bytes or a size "
                             f"such as '2GiB', '512MiB' or '1.5GB'")
        number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"memory budget must be positive and finite, got {value!r}")
    return int(number)


def format_bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"


@dataclass
class Plan:
    """The chosen plan, with what it was chosen over.

    Attributes:
        best: the fastest candidate predicted to fit.
        runners_up: the next fastest that fit.
        rejected: candidates faster than ``best``, each with why it does not fit.
        budget: bytes per rank.
        runner: ``"threads"`` (``Pipe``) or ``"processes"`` (``DistributedPipe``).
        considered: how many candidates were predicted.
    """

    best: Prediction
    runners_up: list[Prediction]
    rejected: list[tuple[Prediction, str]]
    budget: list[int]
    runner: str
    considered: int
    costs: Optional[Costs] = field(default=None, repr=False)

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
        return {"chunks": c.chunks, "balance": list(c.balance), "checkpoint": c.checkpoint}

    def distributed_kwargs(self) -> dict[str, Any]:
        """Arguments of ``DistributedPipe(model, **kwargs)``."""
        c = self.candidate
        return {"chunks": c.chunks, "balance": list(c.balance), "checkpoint": c.checkpoint,
                "schedule": c.schedule, "virtual_stages": c.virtual_stages}

    def table(self, rejected: int = 8) -> str:
        """The chosen plan, the runners-up and the ``rejected`` fastest plans over budget, one line each."""
        lines = [f"memory budget {', '.join(sorted({format_bytes(b) for b in self.budget}))} per rank; "
                 f"{self.considered} candidates ({self.runner})",
                 f"{'':2}{'plan':<60} {'step':>10} {'peak per rank':>40}"]

        def row(mark: str, p: Prediction, why: str = "") -> str:
            peaks = " ".join(format_bytes(b) for b in p.peaks)
            return f"{mark:2}{p.candidate.describe():<60} {p.step_time * 1e3:>8.2f}ms {peaks:>40}" + (
                f"  {why}" if why else "")

        lines.append(row("*", self.best, "chosen"))
        lines += [row("", p) for p in self.runners_up]
        if self.rejected:
            shown = self.rejected[:rejected]
            lines.append(f"faster, but over budget ({len(self.rejected)}"
                         + (f", the {len(shown)} fastest shown):" if len(shown) < len(self.rejected) else "):"))
            lines += [row("x", p, why) for p, why in shown]
        return "\n".join(lines)


def _compositions(layers: int, parts: int) -> Iterable[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _balances(costs: Costs, parts: int, limit: int) -> list[tuple[int, ...]]:
    """Every balance when there are at most ``limit``; else even, by time and by memory, and their
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
             tuple(solve(time, parts)), tuple(solve(memory, parts))}
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
    """The plans :func:`search` compares (``balances``: only these, for the schedules with as many stages)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {sorted(RUNNERS)}, got {runner!r} "
                         f"('threads' plans for Pipe, 'processes' for DistributedPipe)")
    kinds = tuple(schedules) if schedules is not None else RUNNERS[runner]
    unknown = [k for k in kinds if k not in RUNNERS[runner]]
    if unknown:
        raise ValueError(f"schedules {unknown} cannot run with runner={runner!r}; "
                         f"choose from {list(RUNNERS[runner])}")
    bad = [c for c in checkpoints if c not in CHECKPOINT_MODES]
    if bad:
        raise ValueError(f"unknown checkpoint modes {bad}; choose from {list(CHECKPOINT_MODES)}")
    if not 1 <= ranks <= costs.layers:
        raise ValueError(f"cannot split {costs.layers} layers over {ranks} stages; stages must be "
                         f"between 1 and {costs.layers}")
    found = []
    for kind in kinds:
        virtual = 2 if kind == "interleaved" else 1
        if ranks * virtual > costs.layers or (kind == "interleaved" and ranks == 1):
            continue
        if balances is not None:
            options = [tuple(b) for b in balances if len(b) == ranks * virtual and sum(b) == costs.layers]
        else:
            options = _balances(costs, ranks * virtual, max_balances)
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


def search(costs: Costs, ranks: int, memory_budget: Budget, *, runner: str = "threads",
           schedules: Optional[Sequence[str]] = None, checkpoints: Sequence[str] = ("never", "except_last", "always"),
           max_balances: int = 64, balances: Optional[Sequence[Sequence[int]]] = None,
           runners_up: int = 4) -> Plan:
    """The fastest candidate whose predicted peak fits ``memory_budget`` on every rank.

    Args:
        costs: measured (:func:`pipe.plan.cost.profile_costs`) or tabled costs.
        ranks: devices (``Pipe`` partitions or ``DistributedPipe`` pipeline ranks).
        memory_budget: bytes per rank (``"2GiB"``, a number, or one per rank).
        runner: ``"threads"`` (``Pipe``: GPipe) or ``"processes"`` (``DistributedPipe``).
        schedules, checkpoints: restrict the candidates.
        max_balances: enumerate every balance up to this many, else a neighbourhood
            of the even, time- and memory-balanced ones.
        balances: consider only these balances (one entry per stage).

    Raises:
        PlanError: nothing fits; the message names the smallest peak and its plan.
    """
    budget = _budget(memory_budget, ranks)
    options = candidates(costs, ranks, runner, schedules=schedules, checkpoints=checkpoints,
                         max_balances=max_balances, balances=balances)
    if not options:
        raise ValueError(f"no candidate plan: the balances {balances} do not split {costs.layers} layers "
                         f"into {ranks} stages (or 2 x {ranks} for interleaved)")
    predictions = sorted((predict(costs, c, runner=runner, timeline=False) for c in options),
                         key=lambda p: (p.step_time, p.peak))
    fits = [p for p in predictions if all(peak <= b for peak, b in zip(p.peaks, budget))]
    if not fits:
        smallest = min(predictions, key=lambda p: max(peak - b for peak, b in zip(p.peaks, budget)))
        need = max(smallest.peaks)
        raise PlanError(
            f"no plan fits memory_budget={', '.join(sorted({format_bytes(b) for b in budget}))} per rank: "
            f"the smallest predicted peak is {format_bytes(need)} ({need} bytes), reached by "
            f"{smallest.candidate.describe()}; raise memory_budget to at least {format_bytes(need)} or plan "
            f"over more stages")
    best = fits[0]
    faster = predictions[:predictions.index(best)]
    rejected = [(p, _why(p, budget)) for p in faster]
    chosen = Plan(predict(costs, best.candidate, runner=runner), fits[1:1 + runners_up], rejected, budget, runner,
                  len(predictions), costs)
    logger.info("planned %s: predicted step %.3f ms, peaks %s (%d candidates)", best.candidate.describe(),
                best.step_time * 1e3, [format_bytes(b) for b in best.peaks], len(predictions))
    return chosen


def _why(prediction: Prediction, budget: list[int]) -> str:
    over = [(r, peak, b) for r, (peak, b) in enumerate(zip(prediction.peaks, budget)) if peak > b]
    return "; ".join(f"rank {r} needs {format_bytes(peak)} > {format_bytes(b)}" for r, peak, b in over)


def _budget(memory_budget: Budget, ranks: int) -> list[int]:
    if isinstance(memory_budget, (list, tuple)):
        if len(memory_budget) != ranks:
            raise ValueError(f"memory_budget has {len(memory_budget)} entries for {ranks} ranks; "
                             f"give one size, or one per rank")
        return [parse_bytes(b) for b in memory_budget]
    return [parse_bytes(memory_budget)] * ranks  # type: ignore[arg-type]


def plan(model: nn.Sequential, sample: Any, *, memory_budget: Budget, stages: int, runner: str = "threads",
         chunks: Sequence[int] = (1, 2, 4, 8, 16, 32), schedules: Optional[Sequence[str]] = None,
         checkpoints: Sequence[str] = ("never", "except_last", "always"), param_scale: float = 2.0,
         device: Optional[torch.device] = None, rounds: int = 5, max_balances: int = 64,
         bandwidth: Optional[float] = None, latency: float = 0.0,
         loss_fn: Optional[Callable[[Any, Any], Any]] = None, target: Any = None) -> Plan:
    """Measures ``model`` on ``sample`` and returns the fastest plan that fits ``memory_budget``.

    Usage::

        plan = pipe.plan.plan(model, torch.randn(64, 512), memory_budget="1GiB", stages=2)
        model = Pipe(model, **plan.pipe_kwargs())

    Args:
        model: the ``nn.Sequential`` (left untouched: layers are copied to profile).
        sample: one mini-batch, as the pipeline will get it.
        memory_budget: bytes per rank: ``"2GiB"``, a number, or one per rank.
        stages: devices (``Pipe`` partitions or ``DistributedPipe`` pipeline ranks).
        runner: ``"threads"`` for ``Pipe`` (GPipe), ``"processes"`` for ``DistributedPipe``.
        chunks: micro-batch counts to consider (those that divide the batch).
        schedules, checkpoints: restrict the candidates.
        param_scale: copies of the parameters training keeps: 2 for SGD,
            3 with momentum, 4 for Adam.
        device: where to profile (default: the CPU).
        rounds: timed rounds per layer (the fastest is kept).
        bandwidth, latency: bytes/s and seconds per transfer between stages (default: free).
        loss_fn, target: the loss and the mini-batch's targets, so the last
            stage's bytes include the loss (as ``DistributedPipe.step`` computes it).

    Raises:
        PlanError: nothing fits (the message names the smallest budget that does).
        TypeError, ValueError: bad arguments.
    """
    verify_module(model)
    costs = profile_costs(model, sample, chunks, param_scale=param_scale, rounds=rounds, device=device,
                          bandwidth=bandwidth, latency=latency, loss_fn=loss_fn, target=target)
    return search(costs, stages, memory_budget, runner=runner, schedules=schedules, checkpoints=checkpoints,
                  max_balances=max_balances)
