"""Planning a model: measure it once (:mod:`pipe.plan.profile`), then search its plans (:mod:`pipe.plan.search`).

This is the planner's driver, above the front ends: it runs the model (and,
with ``calibrate=True`` or ``link="auto"``, local processes); the search it
hands the measured costs to is the planner's model, which needs no torch.
"""
from __future__ import annotations

import copy
import functools
import os
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from pipe.core.partition import verify_module
from pipe.core.options import REDUCES, UNITS
from pipe.plan.profile import profile_costs, verify_threads
from pipe.plan.search import CHUNKS, Budget, Plan, search
from pipe.plan.sharding import DpShard
from pipe.plan.timing import Link, TimeModel
from pipe.recompute.defaults import DEFAULT_SELECT

__all__: list[str] = []


def plan(model: nn.Sequential, sample: Any, *, memory_budget: Budget, stages: int, runner: str = "threads",
         chunks: Sequence[int] = CHUNKS, schedules: Optional[Sequence[str]] = None,
         checkpoints: Sequence[str] = ("never", "except_last", "always"), param_scale: float = 2.0,
         device: Optional[torch.device] = None, rounds: int = 5, max_balances: int = 64,
         link: Union[Link, str, None] = "auto", model_time: Optional[TimeModel] = None, per_stage: bool = True,
         loss_fn: Optional[Callable[[Any, Any], Any]] = None, target: Any = None, dp_shard: DpShard = None,
         zero: Sequence[int] = (3, 2), select: Sequence[str] = DEFAULT_SELECT, calibrate: bool = False,
         dp_replicate: DpShard = None, threads: Optional[int] = None, units: Sequence[str] = UNITS,
         reduces: Sequence[str] = REDUCES) -> Plan:
    """Measures ``model`` on ``sample`` and returns the fastest plan that fits ``memory_budget``.

    Usage::

        plan = pipe.plan.plan(model, torch.randn(64, 512), memory_budget="1GiB", stages=2)
        model = Pipe(model, **plan.pipe_kwargs())

    Args:
        model: the ``nn.Sequential`` (left untouched: layers are copied to profile).
        sample: one mini-batch, as the pipeline will get it.
        memory_budget: bytes per rank: ``"2GiB"``, a number, or one per rank.
        stages: devices (``Pipe`` partitions or ``DistributedPipe`` pipeline ranks); with
            ``dp_shard`` or ``dp_replicate``, the ranks to split as ``pp x dp_replicate x dp_shard``.
        runner: ``"threads"`` for ``Pipe`` (GPipe), ``"processes"`` for ``DistributedPipe``.
        chunks: micro-batch counts to profile and consider (those that divide the batch); a
            split with ``dp_replicate x dp_shard`` = D plans chunks c from the profile of chunks D*c.
        schedules, checkpoints: restrict the candidates.
        param_scale: copies of the parameters training keeps: 2 for SGD,
            3 with momentum, 4 for Adam.
        device: where to profile (default: the CPU).
        rounds: timed rounds per layer (the fastest is kept).
        link: the transport's cost between ranks (runner ``"processes"``):
            ``"auto"`` measures it once per machine and caches it
            (:func:`pipe.plan.link.cached_link`), ``"cached"`` uses the cache
            only, a :class:`pipe.plan.Link`, or None (messages free). With
            runner ``"threads"`` on the CPU, ``"auto"`` and ``"cached"`` give the
            thread runner's overhead per action the same way
            (:func:`pipe.plan.link.cached_thread_overhead`); otherwise it is 0.
        model_time: a fitted :class:`pipe.plan.TimeModel` (overhead per action,
            contention; :func:`pipe.plan.fit`); its link wins over ``link``.
        per_stage: also plan per-stage recompute where the budget needs it.
        loss_fn, target: the loss and the mini-batch's targets, so the last
            stage's bytes include the loss (as ``DistributedPipe.step`` computes it).
        dp_shard, zero: plan ``stages`` ranks as ``pp x dp_shard`` FSDP splits (:func:`search`;
            ``"auto"``: every divisor), in ZeRO-3 and/or ZeRO-2.
        units, reduces: under ZeRO-3, FSDP gathering a stage whole and/or a layer at a time, reducing a
            layer's gradients once a step and/or after each backward (:func:`search`; default: all).
        dp_replicate: plan full replicas too (:func:`search`): ``pp x dp_replicate``, or HSDP with ``dp_shard``.
        threads: intra-op threads each stage computes with on the CPU, as its layers are timed
            and as the ranks share this machine's cores (``TimeModel.cores``: its cores / threads)
            (:func:`pipe.plan.profile_costs`). Default: 1 with runner ``"processes"`` (torchrun's default
            for several local ranks, and how ``calibrate`` and ``pipe-plan --verify`` run them), this
            process's with ``"threads"``.
        select: name regexes of the selective recompute weighed per stage
            against full recompute (:func:`pipe.plan.profile_costs`); ``()``: full only.
        calibrate: (runner ``"processes"``) first run a few plans of ``model`` on
            local processes and fit the time model to them
            (:func:`pipe.plan.calibrate`; a few seconds per plan); the
            plan's ``calibration`` says what was fitted.

    Raises:
        PlanError: nothing fits (the message names the smallest peak and the rank holding it).
        RuntimeError: a layer cannot be measured (the message names it).
        TypeError, ValueError: bad arguments.
    """
    verify_module(model)
    if calibrate and runner != "processes":
        raise ValueError(f"calibrate=True runs plans on local processes, which is DistributedPipe's runner; got "
                         f"runner={runner!r}: pass runner='processes'")
    if calibrate and model_time is not None:
        raise ValueError("pass either model_time= (a fitted TimeModel) or calibrate=True (fit one here), not both")
    verify_threads(threads)
    if threads is None and runner == "processes":
        threads = 1
    if model_time is None:  # the link and the overhead per action measured on this machine, and its cores
        model_time = TimeModel.measured(_link(link, runner), cores=_shared_cores(runner, device, threads))
        if runner == "threads":
            model_time = replace(model_time, action_overhead=_thread_overhead(link, device))
    costs = profile_costs(model, sample, chunks, param_scale=param_scale, rounds=rounds, device=device,
                          loss_fn=loss_fn, target=target, select=select, threads=threads, stages=stages)
    def chosen(model_time: TimeModel) -> Plan:
        return search(costs, stages, memory_budget, runner=runner, schedules=schedules, checkpoints=checkpoints,
                      max_balances=max_balances, model=model_time, per_stage=per_stage, dp_shard=dp_shard,
                      zero=zero, dp_replicate=dp_replicate, units=units, reduces=reduces)

    if not calibrate:
        return chosen(model_time)
    chosen(model_time)  # a budget that nothing fits fails before the plans run
    from pipe.plan.calibration import calibrate as fit_here

    calibration = fit_here(functools.partial(copy.deepcopy, model), costs, stages, sample, target=target,
                           loss_fn=loss_fn, link=model_time.link, schedules=schedules, cores=model_time.cores)
    return replace(chosen(calibration.model), calibration=calibration)


def _shared_cores(runner: str, device: Optional[torch.device], threads: Optional[int]) -> Optional[float]:
    """The cores that local CPU ranks share, counted in ranks of ``threads`` threads (None: a device each)."""
    if runner != "processes" or (device is not None and torch.device(device).type != "cpu"):
        return None
    return (os.cpu_count() or 1) / (threads or 1)


def _thread_overhead(link: Union[Link, str, None], device: Optional[torch.device]) -> float:
    """The thread runner's measured overhead per action on the CPU, as ``link`` says ("auto": measured once
    per machine and cached; "cached": the cache only); 0 on other devices, where it was not measured."""
    if link not in ("auto", "cached") or (device is not None and torch.device(device).type != "cpu"):
        return 0.0
    from pipe.plan.link import cached_thread_overhead

    return cached_thread_overhead(measure=link == "auto") or 0.0


def _link(link: Union[Link, str, None], runner: str) -> Optional[Link]:
    if link is None or isinstance(link, Link):
        return link
    if link not in ("auto", "cached"):
        raise ValueError(f"link must be 'auto', 'cached', None or a pipe.plan.Link, got {link!r}")
    if runner != "processes":
        return None  # the thread runner's stages share a process
    from pipe.plan.link import cached_link

    return cached_link(measure=link == "auto")
