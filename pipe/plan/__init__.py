"""Planning: choose the fastest plan under a memory budget, and say where idle time went.

Usage::

    import pipe.plan
    model = pipe.plan.planned_pipe(model, sample, memory_budget="2GiB", devices=["cuda:0", "cuda:1"])
    text = model.plan.table()                 # the chosen plan, the runners-up, the rejected

    plan = pipe.plan.plan(model, sample, memory_budget="2GiB", stages=4)   # or plan, then build yourself
    model = Pipe(model, **plan.pipe_kwargs(), devices=...)

    report = pipe.plan.explain(pipe.trace.load("run.json"))   # a measured step
    text = report.table()                     # idle time per rank, by cause

The planner is two layers (tests/test_layers.py). Its **model** needs no
torch: :mod:`~pipe.plan.cost`, :mod:`~pipe.plan.host_copy`,
:mod:`~pipe.plan.timing`, :mod:`~pipe.plan.candidate`,
:mod:`~pipe.plan.candidates`, :mod:`~pipe.plan.predict`,
:mod:`~pipe.plan.sharding` and :mod:`~pipe.plan.search` turn costs into the
fastest plan that fits. Its **driver** measures and builds, above the front
ends: :mod:`~pipe.plan.profile`, :mod:`~pipe.plan.link`,
:mod:`~pipe.plan.measure`, :mod:`~pipe.plan.calibration`,
:mod:`~pipe.plan.planning` (``plan``), :mod:`~pipe.plan.auto` (``auto_schedule``: the search
without a budget, from layer times), :mod:`~pipe.plan.apply` (``planned_pipe``,
``planned_distributed``), :mod:`~pipe.plan.explain` and :mod:`~pipe.plan.cli`.
The front ends never import the planner.

* :mod:`pipe.plan.cost`: per-layer times and per-stage counted bytes, measured once;
* :mod:`pipe.plan.timing`: the time model (each phase's compute as recorded, messages, overhead per
  action, contention) and its one calibration to recorded steps (``fit``); :mod:`pipe.plan.link` measures
  the transport once per machine; :mod:`pipe.plan.calibration` runs and records a few plans
  of the model and calibrates the time model to them (``plan(calibrate=True)``), or, on a job's ranks, chooses the
  order again with the time model calibrated to recorded trial steps (``calibrated_schedule``);
* :mod:`pipe.plan.predict`: a candidate's step time (the schedule simulator with
  those durations) and each rank's peak memory (its program, walked);
* :mod:`pipe.plan.candidates`: the plans compared, per-stage recompute included;
* :mod:`pipe.plan.sharding`: N ranks split as ``pp x dp_replicate x dp_shard`` (replicas, FSDP2, HSDP), their
  memory and collectives;
* :mod:`pipe.plan.search`: the fastest candidate that fits, found best-first;
* :mod:`pipe.plan.explain`: every idle interval of a trace or a plan, with its cause.
"""
from __future__ import annotations

from pipe.plan.cost import Costs, StageMemory
from pipe.plan.profile import profile_costs
from pipe.plan.explain import Explanation, explain, explain_prediction
from pipe.viz.idle import Idle
from pipe.plan.candidate import Candidate
from pipe.plan.predict import Prediction, predict
from pipe.plan.timing import Link, TimeModel, fit
from pipe.plan.calibration import Calibration, calibrate, calibrated_schedule
from pipe.plan.search import Plan, PlanError, search
from pipe.plan.planning import plan
from pipe.plan.auto import AutoSchedule, auto_schedule
from pipe.plan.apply import planned_distributed, planned_pipe
from pipe.core.units import format_bytes, parse_bytes

__all__ = ["AutoSchedule", "auto_schedule", "Calibration", "Candidate", "Costs", "Explanation", "Idle", "Link", "Plan", "PlanError", "Prediction", "StageMemory",
           "TimeModel", "calibrate", "calibrated_schedule", "explain", "fit", "explain_prediction", "format_bytes", "parse_bytes", "plan", "planned_distributed",
           "planned_pipe", "predict",
           "profile_costs", "search"]
