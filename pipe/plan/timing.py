"""The time model: how measured layer times become a predicted step.

A step is more than its layers' times (:class:`pipe.plan.cost.Costs`). The
simulator (:func:`pipe.core.program_time.time_schedule`) places every step
of every rank's lowered program, each lasting::

    compute x phase x contention + action_overhead + messages x message_overhead

and a message's bytes move once it is sent and its receive is posted, so a
step that waits for it ends no earlier than::

    max(sent, posted) + link.latency + bytes x link.per_byte

* ``link``: the transport's cost per message and per byte between two ranks,
  measured once on the machine by sending messages of several sizes
  (:func:`pipe.plan.link.measure_link`, cached on disk); None for the thread
  runner, whose stages hand tensors over in one process;
* ``action_overhead``: what a runner spends per forward or backward beyond
  the layers (posting receives, sending, bookkeeping, Python);
* ``message_overhead``: what each message that an action sends or receives
  to or from another rank costs the action's own rank (the transport's
  copies and threads run on the cores the stages compute on, which a
  ping-pong between idle ranks does not see). An interleaved plan's middle
  stages send and receive twice per action, so without it, such plans were
  predicted 4-16% fast (median per model) in every benchmark run;
* ``phases``: how much slower each phase (F, I, W, B; a recompute as F) computes
  in a running pipeline than the profile timed it alone, read off recorded
  steps (:func:`recorded_phases`); 1 where nothing was recorded;
* ``contention``: how much slower compute runs when the ranks compute at once
  on cores they share (memory bandwidth, the transport's own threads, other
  processes); 1 when every rank has a core to itself and nothing else runs;
* ``cores``: where the ranks outnumber the cores they run on (processes on
  one CPU), how many can compute at once. Each pipeline of a plan with
  data-parallel ranks gets its share (``cores / (dp_replicate x dp_shard)``);
  while more of its ranks compute than it has cores, their compute slows in
  proportion (the cores are shared: each action's compute is stretched by
  the mean number of actions running beside it, over its span, per core, and
  the plan simulated again until it settles). None: a core each.

This is the one calibration (:func:`fit`): each phase's compute is read off
recorded steps of a few plans (:func:`pipe.trace.record`,
:func:`pipe.balance.traced_step`), and the overheads and the contention left
after it are fitted to those plans' step times (least squares on the relative
error) where there are at least as many plans as constants; with fewer, the
overhead per action is read off the recorded steps too. Every other plan is then predicted
with them. On held-out plans, phases read off recorded steps and constants
fitted to step times predict better than either alone
(``benchmarks/calibration_ways.py``). Recomputation and the I/W split need no parameter: their durations
are measured layer times (a checkpointed cell's replay costs its layers'
forwards again; a layer marked for recompute costs what marking it added
when it was timed marked, the forward again and the checkpoint's own work,
1.7-1.8x the forward for a transformer block on the CPU, the median of paired runs; I and W are
timed apart as the runners split them, a fifth longer together than the
backward for a transformer block on the CPU, a stage's halves split once as
its runner splits them: :func:`pipe.balance.timing.time_layers`).
"""
from __future__ import annotations

import bisect
import logging
import math
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from pipe.core.action import Action, TimedAction
    from pipe.plan.cost import Costs
    from pipe.plan.candidate import Candidate
    from pipe.balance.traced import TracedStep

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
        collective_per_byte: FSDP's seconds per byte of a ring step beyond ``per_byte`` (its
            copies into and out of the flat buffers, and the reduction), measured with the link
            on layers larger than the caches.
        reduce_latency, reduce_per_byte: averaging gradients between the two ranks, as the
            replicas' averager does (copied into a flat buffer, all-reduced, divided, copied back),
            costs ``reduce_latency + bytes x reduce_per_byte`` seconds (gloo's reduction on the CPU
            and the copies make it several times a message's cost per byte), measured with the link;
            0 (not measured): the planner takes a ring of messages instead (:meth:`all_reduce`).
    """

    latency: float
    per_byte: float
    source: str = "given"
    action_overhead: float = 0.0
    collective_overhead: float = 0.0
    shard_step_overhead: float = 0.0
    collective_per_byte: float = 0.0
    reduce_latency: float = 0.0
    reduce_per_byte: float = 0.0

    def cost(self, nbytes: int) -> float:
        return self.latency + nbytes * self.per_byte

    def all_reduce(self, nbytes: int, ranks: int) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``ranks`` ranks, as a ring: ``2 (ranks - 1)`` steps, each
        moving and reducing ``nbytes / ranks``; from the measured 2-rank average (``reduce_*``: half its
        latency per step, its per-byte cost spread over the steps; its copies, which do not grow with the
        ranks, are scaled with them: up to 2x over on many ranks), else from the link's messages."""
        if ranks < 2:
            return 0.0
        steps = 2 * (ranks - 1)
        if self.reduce_latency or self.reduce_per_byte:
            return steps * self.reduce_latency / 2 + steps / ranks * nbytes * self.reduce_per_byte
        return steps * self.cost(-(-nbytes // ranks))


@dataclass(frozen=True)
class TimeModel:
    """The parameters that turn layer times into a step time (see the module's docstring)."""

    link: Optional[Link] = None
    action_overhead: float = 0.0
    contention: float = 1.0
    message_overhead: float = 0.0
    cores: Optional[float] = None
    phases: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)

    @classmethod
    def measured(cls, link: Optional[Link], cores: Optional[float] = None) -> "TimeModel":
        """The default model on a machine: its link, the overhead per action measured with it, and the
        ``cores`` the ranks share (None: a core each)."""
        return cls(link=link, action_overhead=link.action_overhead if link else 0.0, cores=cores)

    def __post_init__(self) -> None:
        for name in ("action_overhead", "contention", "message_overhead"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"TimeModel.{name} must be a finite number >= 0, got {value!r}")
        if len(self.phases) != 4 or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                                            for v in self.phases):
            raise ValueError(f"TimeModel.phases must be 4 numbers > 0 (the compute of F, I, W and B over the "
                             f"profile's), got {self.phases!r}")
        if self.cores is not None and not (math.isfinite(self.cores) and self.cores > 0):
            raise ValueError(f"TimeModel.cores must be a number of cores > 0, or None, got {self.cores!r}")

    def describe(self) -> str:
        link = (f"{self.link.latency * 1e6:.0f} us + {self.link.per_byte * 1e9:.3f} ns/B per message"
                if self.link else "no transfer cost")
        if self.link and (self.link.collective_overhead or self.link.shard_step_overhead):
            link += (f" (FSDP: +{self.link.collective_overhead * 1e3:.3f} ms"
                     + (f" + {self.link.collective_per_byte * 1e9:.3f} ns/B" if self.link.collective_per_byte else "")
                     + f" per collective step, {self.link.shard_step_overhead * 1e3:.3f} ms per sharded stage and step)")
        if self.link and (self.link.reduce_latency or self.link.reduce_per_byte):
            link += (f" (all-reduce on 2 ranks: {self.link.reduce_latency * 1e6:.0f} us + "
                     f"{self.link.reduce_per_byte * 1e9:.3f} ns/B)")
        message = f", {self.message_overhead * 1e3:.3f} ms per message sent or received" \
            if self.message_overhead else ""
        cores = f"; {self.cores:g} cores shared by the ranks" if self.cores is not None else ""
        phases = ("; recorded compute over the profile's: " + ", ".join(
            f"{name} x{v:.3f}" for name, v in zip("FIWB", self.phases))) if self.phases != (1.0,) * 4 else ""
        return (f"{link}; overhead {self.action_overhead * 1e3:.3f} ms per action{message}; "
                f"compute x{self.contention:.3f} (contention){cores}{phases}")


SHARING_ROUNDS = 4
"""Simulations that settle how shared cores stretch each action (:func:`shared_stretch`)."""


def shared_stretch(timeline: Sequence["TimedAction"], cores: float) -> dict["Action", float]:
    """How much slower each action of ``timeline`` computes on ``cores`` cores shared by its ranks: the mean
    number of actions running over its span, per core (at least 1: a core each is full speed)."""
    edges = sorted({t.start for t in timeline} | {t.end for t in timeline})
    if len(edges) < 2:
        return {}
    change = dict.fromkeys(edges, 0)
    for t in timeline:
        if t.end > t.start:
            change[t.start] += 1
            change[t.end] -= 1
    running, area, areas, counts = 0, 0.0, [0.0], []  # actions running on each interval, and the integral
    for left, right in zip(edges, edges[1:]):
        running += change[left]
        counts.append(running)
        area += running * (right - left)
        areas.append(area)

    def integral(x: float) -> float:  # of the number running, from the first edge to x
        k = bisect.bisect_right(edges, x) - 1
        if k >= len(counts):
            return areas[-1]
        return areas[k] + counts[k] * (x - edges[k])

    return {t.action: max(1.0, (integral(t.end) - integral(t.start)) / (t.end - t.start) / cores)
            for t in timeline if t.end > t.start}


def recorded_phases(costs: "Costs", traced: Mapping["Candidate", "TracedStep"]) -> tuple[float, float, float, float]:
    """Each phase's compute (F, I, W, B) in recorded steps over what the profile predicts for the same stages:
    per phase, the recorded medians of every stage of every plan summed, over the profile's sums (1 where no
    plan ran the phase).

    A split backward's I and W count apart, and together for B; on the first stage, whose I only replays,
    their sum counts for all three; a fused backward counts for all three.

    Raises:
        ValueError: a recorded step's balance is not its plan's.
    """
    from pipe.plan.predict import stage_costs

    recorded = dict.fromkeys("FIWB", 0.0)
    profiled = dict.fromkeys("FIWB", 0.0)
    for candidate, step in traced.items():
        if tuple(step.balance) != tuple(candidate.balance):
            raise ValueError(f"the step recorded for {candidate.describe()} ran balance {list(step.balance)}: "
                             "record each plan as it is cut")
        want = stage_costs(costs, candidate, TimeModel())
        for s in range(len(candidate.balance)):
            pairs = [("F", step.forward[s], want.forward[s])]
            if not step.split:
                pairs += [(p, step.backward[s], want.backward[s]) for p in "IWB"]
            else:
                both = (step.input_grad[s] + step.weight_grad[s], want.input_grad[s] + want.weight_grad[s])
                if s == 0:
                    pairs += [(p, *both) for p in "IWB"]
                else:
                    pairs += [("I", step.input_grad[s], want.input_grad[s]),
                              ("W", step.weight_grad[s], want.weight_grad[s]), ("B", *both)]
            for phase, got, expected in pairs:
                if math.isfinite(got) and expected > 0:
                    recorded[phase] += got
                    profiled[phase] += expected
    f, i, w, b = (recorded[p] / profiled[p] if profiled[p] > 0 and recorded[p] > 0 else 1.0 for p in "FIWB")
    return (f, i, w, b)


def fit(costs: "Costs", measured: Mapping["Candidate", float], *, traced: Optional[Mapping["Candidate", "TracedStep"]] = None,
        runner: str = "processes", link: Optional[Link] = None, rounds: int = 3,
        cores: Optional[float] = None) -> TimeModel:
    """The time model calibrated to a few plans run where the pipeline runs (see the module docstring).

    With ``traced`` (the plans' recorded steps), each phase's compute is read off them
    (:func:`recorded_phases`). Then ``action_overhead``, ``contention`` and, with a ``link``,
    ``message_overhead`` are fitted to the ``measured`` step times (seconds) where there are at least as many
    plans as these constants; with fewer, and recorded steps, the overhead per action is their median of the
    runner's time per action and contention stays 1 (one step time cannot tell the constants apart).

    The fit minimises the sum of squared relative errors over ``measured``: a
    grid over the parameters, refined ``rounds`` times around the best point,
    then polished by damped Gauss-Newton steps (a step time is piecewise linear
    in the parameters). The cost per message is told from the cost per action
    only by plans whose actions send or receive different numbers of messages
    (interleaved and zero-bubble plans, or stages in the middle of the
    pipeline); fitted on others, it trades against the cost per action and
    both predict alike.

    ``cores``: the cores the ranks share, kept as given (:class:`TimeModel`).

    Raises:
        ValueError: nothing measured or recorded, or a measured time that is not positive.
    """
    from pipe.plan.predict import predict

    if not measured and not traced:
        raise ValueError("fit() needs measured step times of at least one plan, as {candidate: seconds}, or "
                         "their recorded steps (traced=)")
    bad = {c.describe(): t for c, t in measured.items() if not (math.isfinite(t) and t > 0)}
    if bad:
        raise ValueError(f"measured step times must be positive seconds, got {bad}")
    base = TimeModel(link=link, cores=cores, phases=recorded_phases(costs, traced) if traced else (1.0,) * 4)
    constants = 2 + (link is not None)
    if traced and len(measured) < constants:
        model = replace(base, action_overhead=statistics.median(step.overhead for step in traced.values()))
        logger.info("time model read off %d recorded step(s): %s", len(traced), model.describe())
        return model
    plans = list(measured.items())
    actions = max(2 * c.chunks * c.virtual_stages for c, _ in plans)

    def errors(model: TimeModel) -> list[float]:
        return [predict(costs, c, runner=runner, timeline=False, model=model).step_time / t - 1 for c, t in plans]

    def loss(model: TimeModel) -> float:
        return math.fsum(e * e for e in errors(model))

    overhead_span = message_span = (0.0, max(t for _, t in plans) / actions)
    contention_span = (0.5, 3.0)
    best = (loss(base), base)
    for _ in range(rounds):
        for overhead in _grid(*overhead_span, 9):
            for contention in _grid(*contention_span, 9):
                for message in _grid(*message_span, 5) if link is not None else [0.0]:
                    model = replace(base, action_overhead=overhead, contention=contention, message_overhead=message)
                    value = loss(model)
                    if value < best[0]:
                        best = (value, model)
        step_o = (overhead_span[1] - overhead_span[0]) / 8
        step_c = (contention_span[1] - contention_span[0]) / 8
        step_m = (message_span[1] - message_span[0]) / 4
        o, c, m = best[1].action_overhead, best[1].contention, best[1].message_overhead
        overhead_span = (max(0.0, o - step_o), o + step_o)
        contention_span = (max(0.5, c - step_c), c + step_c)
        message_span = (max(0.0, m - step_m), m + step_m)
    best = _polish(best, errors, fit_message=link is not None)
    logger.info("fitted time model on %d plans: %s (rms error %.1f%%)", len(plans), best[1].describe(),
                100 * math.sqrt(best[0] / len(plans)))
    return best[1]


def _polish(best: tuple[float, TimeModel], errors: Callable[[TimeModel], list[float]], fit_message: bool,
            steps: int = 20) -> tuple[float, TimeModel]:
    """Levenberg-Marquardt steps from the grid's best ``(loss, model)``: the Jacobian of the relative
    errors by finite differences, the parameters kept in range (overheads >= 0, contention >= 0.5)."""
    names = ["action_overhead", "contention"] + (["message_overhead"] if fit_message else [])
    scales = {"action_overhead": 1e-3, "contention": 1.0, "message_overhead": 1e-3}  # to comparable units
    floors = {"action_overhead": 0.0, "contention": 0.5, "message_overhead": 0.0}
    damping = 1e-3
    value, model = best
    for _ in range(steps):
        here = errors(model)
        columns = []
        for name in names:
            delta = 1e-4 * scales[name]
            moved = replace(model, **{name: getattr(model, name) + delta})
            columns.append([(e - h) / (delta / scales[name]) for e, h in zip(errors(moved), here)])
        normal = [[math.fsum(a * b for a, b in zip(u, v)) for v in columns] for u in columns]
        damped = [[normal[i][j] + (damping * (normal[i][i] + 1e-12) if i == j else 0.0) for j in range(len(names))]
                  for i in range(len(names))]
        step = _solve(damped, [-math.fsum(a * h for a, h in zip(u, here)) for u in columns])
        trial = replace(model, **{name: max(floors[name], getattr(model, name) + float(d) * scales[name])
                                  for name, d in zip(names, step)})
        trial_value = math.fsum(e * e for e in errors(trial))
        if trial_value < value:
            value, model, damping = trial_value, trial, damping / 10
        else:
            damping *= 10
            if damping > 1e6:
                break
    return value, model


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """``x`` with ``matrix @ x == vector`` (a small, damped and so regular system), by Gaussian elimination
    with partial pivoting."""
    n = len(vector)
    rows = [list(row) + [value] for row, value in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rows[r][n] - math.fsum(rows[r][c] * x[c] for c in range(r + 1, n))) / rows[r][r]
    return x


def _grid(low: float, high: float, points: int) -> list[float]:
    return [low + (high - low) * k / (points - 1) for k in range(points)]

