"""What each stage's actions cost under the runner, from a recorded step: the costs to order by.

A layer timed alone on an idle core (:func:`pipe.balance.time_layers`, the
fastest of its rounds) is cheaper than the same layer in a running pipeline,
where the ranks share the cores, the caches and the memory bus, and where an
action's time varies from one micro-batch to the next. On the 2-core machine a
stage's forward took a fifth longer, median, under the runner than timed
alone, and an order's simulated step from the layer times fell 13-20% short of
the measured one; from a recorded step's medians it came within 3%.

:func:`traced_step` reads the traces of a step (every rank's,
``pipe.trace.record``), and returns each stage's median F, I, W (or fused B)
and the runner's own time per action: everything a rank spent that was
neither compute nor waiting for a message. :meth:`TracedStep.costs` gives the
:class:`~pipe.core.stage_costs.StageCosts` of the cut that ran, and the
planner reads its time model off recorded steps (:func:`pipe.plan.fit` with
``traced=``; :func:`pipe.plan.auto_schedule` with ``measured=``), so that it
can also cut anew::

    with pipe.trace.record(None, rank=rank) as recorder:   # after a warm-up step
        piped.step(x, y, loss_fn)
    traces = [None] * world
    dist.all_gather_object(traces, recorder.trace())
    step = pipe.balance.traced_step(traces, balance=auto.balance)
    auto = pipe.plan.auto_schedule(model, x, ranks=2, chunks=8, times=auto.times, measured=step)
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from pipe.core.stage_costs import StageCosts
from pipe.trace.events import TraceError, load, merge

__all__: list[str] = []

#: Span kinds that are a stage's compute, by the phase letter they cost.
COMPUTE = {"forward": "F", "input": "I", "weight": "W", "backward": "B", "recompute": "R"}
#: Span kinds where a rank waits for a partner (a receive blocks until the message is there).
WAITS = ("recv",)

Trace = Union[Mapping[str, Any], str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TracedStep:
    """A recorded step's costs: per stage, the median seconds of each phase; the runner's time per action.

    Attributes:
        balance: layers per stage of the run that was recorded.
        forward, input_grad, weight_grad, backward: median seconds of each stage's F, I, W and fused B over
            the recorded micro-batches and steps; ``nan`` where the phase never ran (a split backward has no
            B, a fused one no I or W).
        overhead: seconds per action that the ranks spent outside compute and receive waits (sends, the
            runner's own work), the mean over ranks.
        wall: seconds of a step, the slowest rank's (first span to last span), median over the steps.
        steps: steps recorded.
    """

    balance: tuple[int, ...]
    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    backward: tuple[float, ...]
    overhead: float
    wall: float
    steps: int

    @property
    def split(self) -> bool:
        """Whether the backward ran as I and W (else as one B)."""
        return not any(math.isnan(v) for v in self.input_grad + self.weight_grad)

    def costs(self, *, transfer: Union[float, Sequence[float]] = 0.0) -> StageCosts:
        """The :class:`StageCosts` of the recorded cut, the runner's overhead per action included.

        A fused backward's I and W are unknown: each is given half the measured B, and B itself.
        """
        if self.split:
            i, w = list(self.input_grad), list(self.weight_grad)
        else:
            i, w = [b / 2 for b in self.backward], [b / 2 for b in self.backward]
        backward = None if self.split else list(self.backward)
        return StageCosts.of(list(self.forward), i, w, backward=backward, transfer=transfer, overhead=self.overhead)

    def cost_errors(self, costs: StageCosts) -> list["CostError"]:
        """Which action's cost was wrong: each stage's recorded medians against ``costs`` (those an order was
        built and simulated with, e.g. ``AutoSchedule.costs``), and the runner's time per action, the largest
        difference in seconds first. Phases the recorded step did not run (I and W of a fused backward, B of
        a split one) are left out.

        Raises:
            ValueError: ``costs`` has another number of stages than the recorded step.
        """
        if costs.stages != len(self.forward):
            raise ValueError(f"costs of {costs.stages} stages cannot be compared with a recorded step of "
                             f"{len(self.forward)}: pass the costs of the order that was recorded")
        phases = (("F", self.forward, costs.forward),) + ((("I", self.input_grad, costs.input_grad),
                                                           ("W", self.weight_grad, costs.weight_grad))
                                                          if self.split else (("B", self.backward, costs.backward),))
        found = [CostError(phase, stage, predicted[stage], measured[stage]) for phase, measured, predicted in phases
                 for stage in range(costs.stages)]
        found.append(CostError("overhead", -1, costs.overhead, self.overhead))
        return sorted(found, key=lambda e: -abs(e.measured - e.predicted))


@dataclass(frozen=True)
class CostError:
    """One cost an order was built with, against the recorded step: ``phase`` (``F``, ``I``, ``W``, ``B``, or
    ``overhead``: the runner's time per action, ``stage`` -1) of ``stage``, in seconds."""

    phase: str
    stage: int
    predicted: float
    measured: float

    def __str__(self) -> str:
        what = "the runner's time per action" if self.phase == "overhead" else f"{self.phase} of stage {self.stage}"
        ratio = f"{self.measured / self.predicted:.2f}x" if self.predicted > 0 else "its cost was 0"
        return (f"{what}: recorded {self.measured * 1e3:.3f} ms against {self.predicted * 1e3:.3f} ms "
                f"({ratio})")


def _key(event: Mapping[str, Any]) -> tuple[Any, ...]:
    args = event.get("args", {})
    return event["pid"], event.get("cat"), args.get("microbatch"), args.get("stage"), args.get("channel")


def traced_step(traces: Union[Trace, Sequence[Trace]], *, balance: Sequence[int]) -> TracedStep:
    """The costs of the step(s) recorded in ``traces`` (see the module docstring).

    Args:
        traces: one merged trace, or each rank's (dicts as ``Recorder.trace()`` returns, or file paths).
            Record whole steps only, after a warm-up step: each cell's actions occur once per step.
        balance: the layers per stage of the recorded run (``DistributedPipe``'s ``balance``).

    Raises:
        TraceError: a trace cannot be read, holds no compute spans, or holds part of a step (a cell's action
            recorded fewer times than another's); ``balance`` does not match the stages recorded.
    """
    listed = [traces] if isinstance(traces, (Mapping, str, os.PathLike)) else list(traces)
    trace = merge([t if isinstance(t, Mapping) else load(t) for t in listed])
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    compute = [e for e in spans if e.get("cat") in COMPUTE and e.get("args", {}).get("stage") is not None]
    if not compute:
        raise TraceError("the trace holds no forward or backward spans of a stage: record a step of "
                         "DistributedPipe inside pipe.trace.record(...) on every rank")
    stages = 1 + max(e["args"]["stage"] for e in compute)
    if len(balance) != stages or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise TraceError(f"balance {list(balance)} does not match the {stages} stages recorded: pass the "
                         f"balance the recorded run used (DistributedPipe's balance=)")
    occurrences: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for event in spans:
        occurrences.setdefault(_key(event), []).append(event)
    counts = {key: len(found) for key, found in occurrences.items() if key[1] in COMPUTE}
    steps = min(counts.values())
    if max(counts.values()) != steps:
        short = min(counts, key=lambda k: counts[k])
        raise TraceError(f"the trace holds part of a step: {short[1]} of micro-batch {short[2]} on stage {short[3]} "
                         f"ran {counts[short]} times, other actions {max(counts.values())}; record whole steps "
                         f"(the with-block around complete piped.step(...) calls)")
    step_of: dict[int, int] = {}  # id(event) -> which step it belongs to: the k-th occurrence of its key
    for found in occurrences.values():
        for k, event in enumerate(sorted(found, key=lambda e: e["ts"])):
            step_of[id(event)] = min(k * steps // len(found), steps - 1)
    walls: dict[int, list[float]] = {}
    overheads = []
    for rank in sorted({e["pid"] for e in spans}):
        mine = [e for e in spans if e["pid"] == rank]
        windows = []
        for k in range(steps):
            inside = [e for e in mine if step_of[id(e)] == k]
            windows.append(max(e["ts"] + e["dur"] for e in inside) - min(e["ts"] for e in inside))
        walls[rank] = windows
        busy = math.fsum(e["dur"] for e in mine if e.get("cat") in COMPUTE or e.get("cat") in WAITS)
        gaps = sum(1 for e in mine if e.get("cat") in COMPUTE) - steps  # between a step's actions
        if gaps > 0:
            overheads.append(max(0.0, math.fsum(windows) - busy) / gaps)
    medians: dict[str, list[float]] = {phase: [] for phase in "FIWB"}
    for phase in medians:
        for stage in range(stages):
            durations = [float(e["dur"]) for e in compute if COMPUTE[e["cat"]] == phase and e["args"]["stage"] == stage]
            medians[phase].append(statistics.median(durations) * 1e-6 if durations else math.nan)
    if any(math.isnan(f) for f in medians["F"]):
        missing = [s for s, f in enumerate(medians["F"]) if math.isnan(f)]
        raise TraceError(f"the trace holds no forward of stage(s) {missing}: record every rank's trace")
    wall = statistics.median(max(walls[r][k] for r in walls) for k in range(steps)) * 1e-6
    return TracedStep(tuple(balance), tuple(medians["F"]), tuple(medians["I"]), tuple(medians["W"]),
                      tuple(medians["B"]), (statistics.fmean(overheads) if overheads else 0.0) * 1e-6, wall, steps)
