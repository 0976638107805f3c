"""The time model: how measured layer times become a predicted step.

A step is more than its layers' times (:class:`pipe.plan.cost.Costs`). The
simulator (:meth:`pipe.core.schedule.Schedule.simulate`) places every action
of every rank, each lasting::

    compute x contention + action_overhead

and an action that waits for another rank's action starts only once that
action's message has arrived::

    start >= end of the awaited action + link.latency + bytes x link.per_byte

* ``link``: the transport's cost per message and per byte between two ranks,
  measured once on the machine by sending messages of several sizes
  (:func:`pipe.plan.link.measure_link`, cached on disk); None for the thread
  runner, whose stages hand tensors over in one process;
* ``action_overhead``: what a runner spends per forward or backward beyond
  the layers (posting receives, sending, bookkeeping, Python);
* ``contention``: how much slower compute runs when the ranks compute at once
  on cores they share (memory bandwidth, the transport's own threads, other
  processes); 1 when every rank has a core to itself and nothing else runs.

The last two are fitted by :func:`fit` to measured steps of a few plans
(least squares on the relative error), then every other plan is predicted
with them; ``benchmarks/planner.py`` validates them on more plans than were
fitted. Recomputation and the I/W split need no parameter: their durations
are measured layer times (a checkpointed cell's replay costs its layers'
forwards again; a layer marked for recompute costs what marking it added
when it was timed marked, the forward again and the checkpoint's own work,
about 30% more than the forward for a transformer block on the CPU; I and W are
timed apart as the runners split them, a fifth longer together than the
backward for a transformer block on the CPU).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from pipe.plan.cost import Costs
    from pipe.plan.predict import Candidate

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """One message between two ranks costs ``latency + bytes * per_byte`` seconds.

    Attributes:
        latency: seconds per message, whatever its size.
        per_byte: seconds per byte (1 / bandwidth).
        source: where the figures come from (the machine and library measured, or "given").
        action_overhead: the runner's seconds per action measured with the link
            (:func:`pipe.plan.link.measure_link`), the default of :class:`TimeModel`.
        collective_overhead: FSDP's seconds per ring step of a gather or a reduce-scatter of
            one group beyond ``latency`` (its hooks, copies in and out), measured with the link.
        shard_step_overhead: FSDP's seconds per sharded stage and step (its root's
            pre-forward and post-backward callbacks), measured with the link.
    """

    latency: float
    per_byte: float
    source: str = "given"
    action_overhead: float = 0.0
    collective_overhead: float = 0.0
    shard_step_overhead: float = 0.0

    def cost(self, nbytes: int) -> float:
        return self.latency + nbytes * self.per_byte


@dataclass(frozen=True)
class TimeModel:
    """The parameters that turn layer times into a step time (see the module's docstring)."""

    link: Optional[Link] = None
    action_overhead: float = 0.0
    contention: float = 1.0

    @classmethod
    def measured(cls, link: Optional[Link]) -> "TimeModel":
        """The default model on a machine: its link, and the overhead per action measured with it."""
        return cls(link=link, action_overhead=link.action_overhead if link else 0.0)

    def __post_init__(self) -> None:
        for name in ("action_overhead", "contention"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"TimeModel.{name} must be a finite number >= 0, got {value!r}")

    def describe(self) -> str:
        link = (f"{self.link.latency * 1e6:.0f} us + {self.link.per_byte * 1e9:.3f} ns/B per message"
                if self.link else "no transfer cost")
        if self.link and (self.link.collective_overhead or self.link.shard_step_overhead):
            link += (f" (FSDP: +{self.link.collective_overhead * 1e3:.3f} ms per collective step, "
                     f"{self.link.shard_step_overhead * 1e3:.3f} ms per sharded stage and step)")
        return (f"{link}; overhead {self.action_overhead * 1e3:.3f} ms per action; "
                f"compute x{self.contention:.3f} (contention)")


def fit(costs: "Costs", measured: Mapping["Candidate", float], *, runner: str = "processes",
        link: Optional[Link] = None, rounds: int = 3) -> TimeModel:
    """Fits ``action_overhead`` and ``contention`` to measured step times (seconds) of a few plans.

    The fit minimises the sum of squared relative errors over ``measured``: a
    grid over both parameters, refined ``rounds`` times around the best point.
    Every other plan is then predicted with the result.

    Raises:
        ValueError: nothing measured, or a measured time that is not positive.
    """
    from pipe.plan.predict import predict

    if not measured:
        raise ValueError("fit() needs measured step times of at least one plan, as {candidate: seconds}")
    bad = {c.describe(): t for c, t in measured.items() if not (math.isfinite(t) and t > 0)}
    if bad:
        raise ValueError(f"measured step times must be positive seconds, got {bad}")
    plans = list(measured.items())
    base = TimeModel(link=link)
    actions = max(2 * c.chunks * c.virtual_stages for c, _ in plans)

    def loss(model: TimeModel) -> float:
        return math.fsum((predict(costs, c, runner=runner, timeline=False, model=model).step_time / t - 1) ** 2
                         for c, t in plans)

    overhead_span = (0.0, max(t for _, t in plans) / actions)
    contention_span = (0.5, 3.0)
    best = (loss(base), base)
    for _ in range(rounds):
        overheads = _grid(*overhead_span, 9)
        contentions = _grid(*contention_span, 9)
        for overhead in overheads:
            for contention in contentions:
                model = replace(base, action_overhead=overhead, contention=contention)
                value = loss(model)
                if value < best[0]:
                    best = (value, model)
        step_o = (overhead_span[1] - overhead_span[0]) / 8
        step_c = (contention_span[1] - contention_span[0]) / 8
        o, c = best[1].action_overhead, best[1].contention
        overhead_span = (max(0.0, o - step_o), o + step_o)
        contention_span = (max(0.5, c - step_c), c + step_c)
    logger.info("fitted time model on %d plans: %s (rms error %.1f%%)", len(plans), best[1].describe(),
                100 * math.sqrt(best[0] / len(plans)))
    return best[1]


def _grid(low: float, high: float, points: int) -> list[float]:
    return [low + (high - low) * k / (points - 1) for k in range(points)]

