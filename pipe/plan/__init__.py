"""Planning: choose the fastest plan under a memory budget, and say where idle time went.

Usage::

    import pipe.plan
    plan = pipe.plan.plan(model, sample, memory_budget="2GiB", stages=4)
    text = plan.table()                       # the chosen plan, the runners-up, the rejected
    model = Pipe(model, **plan.pipe_kwargs())

    report = pipe.plan.explain(pipe.trace.load("run.json"))   # a measured step
    text = report.table()                     # idle time per rank, by cause

* :mod:`pipe.plan.cost`: per-layer times and per-stage counted bytes, measured once;
* :mod:`pipe.plan.timing`: the time model (messages, overhead per action,
  contention) and its fit to measured steps; :mod:`pipe.plan.link` measures
  the transport once per machine; :mod:`pipe.plan.calibration` runs a few plans
  of the model and fits the time model to them (``plan(calibrate=True)``);
* :mod:`pipe.plan.predict`: a candidate's step time (the schedule simulator with
  those durations) and each rank's peak memory (its program, walked);
* :mod:`pipe.plan.candidates`: the plans compared, per-stage recompute included;
* :mod:`pipe.plan.sharding`: N ranks split as ``pp x dp_replicate x dp_shard`` (replicas, FSDP2, HSDP), their
  memory and collectives;
* :mod:`pipe.plan.search`: the fastest candidate that fits, found best-first;
* :mod:`pipe.plan.explain`: every idle interval of a trace or a plan, with its cause.
"""
from __future__ import annotations

from pipe.plan.cost import Costs, StageMemory, StageTime
from pipe.plan.profile import profile_costs
from pipe.plan.explain import Explanation, explain, explain_prediction
from pipe.viz.idle import Idle
from pipe.plan.candidate import Candidate
from pipe.plan.predict import Prediction, predict
from pipe.plan.timing import Link, TimeModel, fit
from pipe.plan.calibration import Calibration, calibrate
from pipe.plan.search import Plan, PlanError, plan, search
from pipe.plan.units import format_bytes, parse_bytes

__all__ = ["Calibration", "Candidate", "Costs", "Explanation", "Idle", "Link", "Plan", "PlanError", "Prediction", "StageMemory",
           "StageTime", "TimeModel", "calibrate", "explain", "fit", "explain_prediction", "format_bytes", "parse_bytes", "plan", "predict",
           "profile_costs", "search"]
