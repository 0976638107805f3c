"""Calibration: the planner's time model measured where the pipeline runs, one way.

Layers timed alone on an idle core are cheaper than in a running pipeline
(ranks share the cores and the memory bus), and a pipeline adds work of its
own (the runner's time per action, per message); a step predicted from the
layer times alone is off by that much (on the 2-core machine a fifth). A
calibration runs plans of the model, records their steps
(:func:`pipe.trace.record`, read by :func:`pipe.balance.traced_step`), and
calibrates the time model to them (:func:`pipe.plan.fit` with ``traced=``):
each phase's compute (F, I, W, B) is read off the recorded steps, as their
medians over the profile's, and the overheads and contention that remain are
fitted to the plans' step times where there are at least as many plans as
constants, else read off the recorded steps too. It runs in one of two places:

**Before a job, on local processes** (:func:`calibrate`): a few plans of the
model on local gloo processes, one per schedule family and from few
micro-batches to many (the overhead per action and the compute scale apart
only when the number of actions varies; the cost per message only when
actions carry different numbers of messages, as interleaved and zero-bubble
plans do), each plan's fastest step over a few sweeps and the trace of its
sweep::

    calibration = pipe.plan.calibrate(lambda: copy.deepcopy(model), costs, 2, sample)
    plan = pipe.plan.search(costs, 2, "1GiB", runner="processes", model=calibration.model)

or in one call, ``pipe.plan.plan(model, sample, ..., runner="processes", calibrate=True)``
(``pipe-plan --calibrate``). It costs a few seconds per plan;
``benchmarks/calibration_ways.py`` says how far it brings predictions of
plans it did not run.

**On the ranks themselves** (:func:`calibrated_schedule`, one call on every
rank of a running job), for an order built from the costs:

1. rank 0 times the layers and chooses a cut and an order
   (:func:`pipe.plan.auto_schedule`);
2. every rank runs that order on a copy of the model, ``WARMUP`` steps and
   then ``steps`` steps recorded;
3. rank 0 reads the time model off every step recorded so far and chooses
   again with it (``auto_schedule(measured=...)``);

steps 2 and 3 ``rounds`` times, or until the choice stays the same. Every
rank returns rank 0's :class:`~pipe.plan.AutoSchedule` (timings differ
between processes; the table must not)::

    auto = pipe.plan.calibrated_schedule(model, x, y, chunks=8, loss_fn=F.cross_entropy)
    piped = DistributedPipe(model, chunks=8, schedule=auto.schedule, balance=auto.balance, loss_fn=F.cross_entropy)

The trial steps run on copies: ``model``'s weights and gradients are left as
they were, and each rank holds a second copy of the model until the call
returns. The model must be real, not built on ``meta``: its layers are run.
"""
from __future__ import annotations

import copy
import gc
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch import nn

import pipe.trace
from pipe.balance.traced import traced_step
from pipe.core.options import positive_int
from pipe.distributed.distributed_pipe import DistributedPipe
from pipe.distributed.group import decided_on_rank_0
from pipe.plan.auto import AutoSchedule, auto_schedule
from pipe.plan.candidates import candidates
from pipe.plan.cost import Costs
from pipe.plan.measure import mean_output_loss, pipeline_steps, run_plans
from pipe.plan.candidate import Candidate
from pipe.plan.predict import predict
from pipe.plan.timing import Link, TimeModel, fit

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The plans fitted on: (schedule, micro-batches near, checkpoint mode); those the model and ranks allow.
CALIBRATION: tuple[tuple[str, int, str], ...] = (
    ("gpipe", 1, "never"), ("1f1b", 8, "never"), ("interleaved", 4, "always"), ("zb-h1", 2, "never"),
    ("zbv", 8, "never"))

SPREAD_WARNING = 0.2
"""A calibration warns where its plans' median step ran more than this over their fastest (at the median plan):
the machine's speed changed under it, and the fitted constants are as uncertain."""


def calibration_plans(grid: Sequence[Candidate], costs: Costs) -> list[Candidate]:
    """Of ``grid``, the plans to fit on: for each entry of :data:`CALIBRATION` whose schedule ``grid`` has,
    the plan with the nearest micro-batch count and, among those, the balance whose slowest stage is the
    fastest (by the profile's forward and backward times), without recompute marks."""
    rows = max(costs.forward)
    layer_time = [f + b for f, b in zip(costs.forward[rows], costs.backward[rows])]

    def slowest_stage(c: Candidate) -> float:
        bounds = [sum(c.balance[:s]) for s in range(len(c.balance) + 1)]
        return max(math.fsum(layer_time[a:b]) for a, b in zip(bounds, bounds[1:]))

    chosen = []
    for kind, chunks, checkpoint in CALIBRATION:
        match = [c for c in grid if c.schedule == kind and c.checkpoint == checkpoint and not any(c.recompute)
                 and not c.selective() and c.parts == 1]
        if match:
            chosen.append(min(match, key=lambda c: (abs(c.chunks - chunks), slowest_stage(c), c.balance)))
    return chosen


@dataclass(frozen=True)
class Calibration:
    """A fitted time model and what it was fitted on.

    Attributes:
        model: the fitted :class:`TimeModel` (pass it as ``model=`` to :func:`pipe.plan.search`).
        measured: each calibration plan's step time, the fastest over the sweeps (seconds; the slowest rank).
        errors: each calibration plan's predicted step with ``model``, relative to the measured one.
        spread: each calibration plan's median step over its fastest, less 1 (every timed step of every
            sweep, each its slowest rank's): how far the machine's speed moved while it ran.
    """

    model: TimeModel
    measured: dict[Candidate, float]
    errors: dict[Candidate, float]
    spread: dict[Candidate, float] = field(default_factory=dict)

    def describe(self) -> str:
        rms = math.sqrt(math.fsum(e * e for e in self.errors.values()) / max(len(self.errors), 1))
        moved = (f"; a plan's median step +{statistics.median(self.spread.values()):.1%} over its fastest, at the "
                 "median plan" if self.spread else "")
        return (f"calibrated on {len(self.measured)} plans run here (rms error {rms:.1%}{moved}): "
                + ", ".join(f"{c.describe()} {t * 1e3:.1f} ms" for c, t in self.measured.items()))


def calibrate(build: Callable[[], nn.Module], costs: Costs, stages: int, sample: Any, *, target: Any = None,
              loss_fn: Optional[Callable[[Any, Any], Any]] = None, link: Optional[Link] = None,
              schedules: Optional[Sequence[str]] = None, plans: Optional[Sequence[Candidate]] = None,
              sweeps: int = 2, repeat: int = 3, timeout: float = 600.0, cores: Optional[float] = None) -> Calibration:
    """Runs a few plans of the model on ``stages`` local gloo processes and fits the time model to them.

    Args:
        build: returns a fresh copy of the model (``functools.partial(copy.deepcopy, model)``); where a GPU is
            visible it is pickled to the ranks (:func:`pipe.plan.measure.run_plans`), so it must pickle.
        costs: the model's profile (:func:`pipe.plan.profile_costs`), measured on ``sample``.
        stages: pipeline ranks (the plans are not sharded).
        sample, target: one mini-batch and its targets (default: the sample).
        loss_fn: the loss of each step (default: the mean of the output).
        link: the transport's cost between ranks (:func:`pipe.plan.link.cached_link`); None: messages free,
            and no cost per message is fitted.
        schedules: restrict the calibration plans to these schedules (default: every one the ranks allow).
        plans: the plans to run instead of :func:`calibration_plans`'s (on ``stages`` ranks, unsharded).
        sweeps: times each plan runs, in turn with the others; its fastest step counts.
        repeat: timed steps per plan and sweep (the fastest counts).
        cores: the cores the ranks share (:class:`pipe.plan.TimeModel`), kept in the fitted model.

    Raises:
        ValueError: no plan to calibrate on, or plans on other than ``stages`` ranks.
        RuntimeError: a plan failed on the ranks, or took longer than ``timeout`` seconds in all.
    """
    if sweeps < 1 or repeat < 1:
        raise ValueError(f"sweeps and repeat must be >= 1, got sweeps={sweeps}, repeat={repeat}")
    chosen = list(plans) if plans is not None else calibration_plans(
        candidates(costs, stages, "processes", schedules=schedules), costs)
    if not chosen:
        raise ValueError(f"no plan to calibrate on: {costs.layers} layers over {stages} ranks"
                         + (f" with schedules {list(schedules)}" if schedules else ""))
    wrong = [c.describe() for c in chosen if c.world != stages or c.parts != 1]
    if wrong:
        raise ValueError(f"calibration plans must run on {stages} pipeline ranks, without replicas or shards: {wrong}")
    logger.info("calibrating the time model on %d plans, %d sweeps", len(chosen), sweeps)
    measured = run_plans(build, chosen, sample, sample if target is None else target, loss_fn or mean_output_loss,
                         repeat=repeat, sweeps=sweeps, timeout=timeout, record=True)
    times = {c: max(m.step_time for m in ranks) for c, ranks in zip(chosen, measured)}
    traced = {c: traced_step([m.trace for m in ranks if m.trace is not None], balance=c.balance)
              for c, ranks in zip(chosen, measured)}
    steps = {c: pipeline_steps(ranks) for c, ranks in zip(chosen, measured)}
    spread = {c: statistics.median(s) / min(s) - 1 for c, s in steps.items() if s}
    if spread and statistics.median(spread.values()) > SPREAD_WARNING:
        logger.warning("calibrating: a plan's median step ran %.0f%% over its fastest (the median plan): the "
                       "machine's speed changed while the plans ran, so the fitted time model is as uncertain; "
                       "calibrate with nothing else running, or with more sweeps", 100 * statistics.median(spread.values()))
    model = fit(costs, times, traced=traced, runner="processes", link=link, cores=cores)
    errors = {c: predict(costs, c, runner="processes", timeline=False, model=model).step_time / t - 1
              for c, t in times.items()}
    return Calibration(model, times, errors, spread)


#: Steps each trial runs before it records: the first allocates, the second still runs slow on the CPU.
WARMUP = 2

#: DistributedPipe arguments the calibration chooses or that change the ranks it plans for.
CHOSEN = ("schedule", "balance", "virtual_stages", "chunks", "checkpoint", "mesh", "shard",
          "parallelize", "tensor_parallel")


def calibrated_schedule(model: nn.Sequential, inputs: Any, target: Any = None, *, chunks: int, loss_fn: Any,
                        checkpoint: str = "except_last", rounds: int = 2, steps: int = 3, timeout: float = 1.0,
                        pipe_options: Optional[dict[str, Any]] = None, **order: Any) -> AutoSchedule:
    """The cut and each rank's order for ``DistributedPipe``, from costs measured on these ranks (see the module
    docstring). Collective: every rank of the world calls it, the world being the pipeline's ranks.

    Args:
        model: the ``nn.Sequential`` to cut, the same on every rank (left untouched: trials run on copies).
        inputs, target: one mini-batch as ``DistributedPipe.step`` takes it, on every rank.
        chunks, loss_fn, checkpoint: as the pipeline will run (``DistributedPipe``'s).
        rounds: times to run the latest choice and choose again by its recorded costs (0: by the layer times
            only).
        steps: steps recorded per round (each stage's costs are medians over their micro-batches).
        timeout: seconds rank 0 times the layers.
        pipe_options: other ``DistributedPipe`` arguments for the trials (``device``, ``loss_reduction``...).
        order: :func:`pipe.plan.auto_schedule`'s options (``placement``, ``seconds_per_byte``,
            ``message_seconds``, ``action_seconds``).

    Returns:
        Rank 0's :class:`~pipe.plan.AutoSchedule`, on every rank; ``measured`` is the last recorded step.

    Raises:
        ValueError: a bad argument (on every rank), or no process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("calibrated_schedule runs on the pipeline's ranks: call pipe.distributed.init_from_env() "
                         "first (under torchrun)")
    positive_int("chunks", chunks, "micro-batches per step")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0 (trial runs to calibrate by), got {rounds!r}")
    positive_int("steps", steps, "steps recorded per round")
    options = dict(pipe_options or {})
    clash = sorted(set(options) & set(CHOSEN))
    if clash:
        raise ValueError(f"pipe_options may not give {clash}: the calibration chooses the schedule and the cut "
                         f"for the world's ranks as one pipeline (chunks= and checkpoint= are its own arguments)")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("calibrated_schedule runs the model to time it; build it on a real device, not on "
                         "torch.device('meta')")
    ranks = dist.get_world_size()
    auto: AutoSchedule = decided_on_rank_0(lambda: auto_schedule(
        model, inputs, ranks=ranks, chunks=chunks, checkpoint=checkpoint, timeout=timeout, **order))
    for done in range(rounds):
        trial = DistributedPipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, schedule=auto.schedule,
                                balance=auto.balance, loss_fn=loss_fn, **options)
        for _ in range(WARMUP):
            trial.step(inputs, target)
            trial.zero_grad(set_to_none=True)
        with pipe.trace.record(None, rank=dist.get_rank()) as recorder:
            for _ in range(steps):
                trial.step(inputs, target)
                trial.zero_grad(set_to_none=True)
        del trial
        gc.collect()  # the trial pipeline's copy of the model sits in reference cycles: free it now
        traces: list[Any] = [None] * ranks
        dist.all_gather_object(traces, recorder.trace())
        before = auto
        auto = decided_on_rank_0(lambda: auto_schedule(
            model, ranks=ranks, chunks=chunks, checkpoint=checkpoint, times=before.times,
            measured=before.measured + (traced_step(traces, balance=before.balance),), **order))
        logger.info("calibration %d: %s ran %.4g s per step (simulated: %.4g s); by the time model read off the "
                    "%d recorded step(s) (%s) chose %s, balance %s, simulated %.4g s", done + 1,
                    before.schedule.name, auto.measured[-1].wall, before.step, len(auto.measured),
                    auto.model.describe(), auto.schedule.name, auto.balance, auto.step)
        if auto.balance == before.balance and auto.schedule.programs == before.schedule.programs:
            break
    return auto
