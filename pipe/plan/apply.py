"""Building a planned pipeline: :func:`planned_pipe` and :func:`planned_distributed`.

They take a memory budget and a sample mini-batch, plan
(:func:`pipe.plan.plan`) and build ``Pipe`` or ``DistributedPipe`` with the
plan's chunks, balance, checkpoint mode and per-stage recompute (and, for
processes, schedule and virtual stages). A ``chunks``, ``checkpoint`` or
``schedule`` given is kept: the plan is searched among the plans with it.
What the planner cannot count (a balance or recompute marks of the user's, a
``parallelize`` function, tensor parallelism, FSDP's mixed precision, a
schedule given as a table) is refused. Processes must agree on one plan, so
the first rank plans and broadcasts it: profiles measured on several ranks
differ a little. The front ends know nothing of the planner: the planner
builds them (this module is the planner's driver, above the front ends).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipe.compile import CompileOption, verify_compile
from pipe.core.options import verify_checkpoint, verify_chunks
from pipe.core.partition import Device
from pipe.distributed.distributed_pipe import DistributedPipe
from pipe.distributed.env import rank_device
from pipe.core.options import REDUCES, UNITS
from pipe.distributed.fsdp import Shard, verify_shard
from pipe.distributed.group import decided_on_rank_0, require_initialized
from pipe.distributed.mesh import mesh_size, verify_mesh
from pipe.pipe import Pipe
from pipe.plan.planning import plan
from pipe.plan.search import CHUNKS, Budget, Plan, PlanError
from pipe.recompute.config import ConfigSource
from pipe.threads.worker import partition_threads

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Given:
    """What :func:`planned_pipe` or :func:`planned_distributed` was given beside the budget.

    ``chunks``, ``checkpoint`` and ``schedule`` are those given (None: the plan chooses them): the plan keeps them. ``balance``, ``recompute`` and
    ``parallelize`` are refused; ``compiled`` warns; ``virtual_stages`` other than the plan's (2 for
    "interleaved" and "zbv", else 1) is refused. ``threads``: ``Pipe``'s ``cpu_threads``, as given.
    """

    balance: Optional[Sequence[int]] = None
    recompute: Any = None
    compiled: bool = False
    parallelize: Any = None
    chunks: Optional[int] = None
    checkpoint: Optional[str] = None
    schedule: Any = None
    virtual_stages: Optional[int] = None
    threads: Optional[int] = None

    def restrictions(self, parts: int = 1) -> dict[str, Any]:
        """``pipe.plan.plan``'s arguments that keep what was given (``chunks`` per pipeline: each of the
        ``parts`` pipelines planned together gets its own)."""
        found: dict[str, Any] = {"chunks": [parts * c for c in CHUNKS]}
        if self.chunks is not None:
            found["chunks"] = [parts * self.chunks]
        if self.checkpoint is not None:
            found["checkpoints"] = [self.checkpoint]
        if self.schedule is not None:
            found["schedules"] = [self.schedule]
        return found

    def describe(self) -> str:
        kept = [f"{name}={value!r}" for name, value in (("chunks", self.chunks), ("checkpoint", self.checkpoint),
                                                          ("schedule", self.schedule)) if value is not None]
        return ", ".join(kept)


def _check(module: Any, sample: Any, front: str, given: Given) -> None:
    if given.compiled:
        warnings.warn(f"{front}(..., compile=...) plans the layers as they run eager: the "
                      f"plan's predicted peaks and step times are eager layers', and compiled ones keep other "
                      f"activations (and run faster); leave a margin in the budget, or measure the compiled "
                      f"model's peak before training at scale", UserWarning, stacklevel=4)
    if sample is None:
        raise ValueError(f"{front}() needs sample, one mini-batch as the pipeline will get it, to measure the "
                         f"model on")
    if given.balance is not None:
        raise ValueError(f"{front}() chooses the balance; leave balance= out (got {given.balance!r}), or "
                         f"build the pipeline with balance= yourself, unplanned")
    if given.recompute is not None:  # the plan's peaks hold for its own recompute marks (or none), not for others
        raise ValueError(f"{front}() chooses what each stage recomputes, and its predicted "
                         f"peaks hold for that alone; leave recompute= out, or plan with pipe.plan.plan() and "
                         f"pass its arguments with recompute= of your own (its peaks then no longer hold)")
    if given.chunks is not None:
        verify_chunks(given.chunks)
    if given.checkpoint is not None:
        verify_checkpoint(given.checkpoint)
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"{front}() plans an nn.Sequential, got {type(module).__name__}; "
                        f"build the model, or plan with pipe.plan.plan() and pass the arguments")


def _planned(front: str, given: Given, search: Callable[[], Plan]) -> Plan:
    """``search()``, whose :class:`PlanError` also says which given arguments narrowed it."""
    try:
        return search()
    except PlanError as error:
        if not given.describe():
            raise
        raise PlanError(f"{error} (among the plans with {given.describe()}, as given to {front}: leave them out "
                        f"to let the plan choose them)") from None


def plan_for_pipe(module: Any, sample: Any, memory_budget: Budget, devices: Optional[Sequence[Any]],
                  given: Given) -> Plan:
    """The plan ``Pipe`` applies: GPipe over ``devices`` (one stage each).

    Raises:
        ValueError: no ``sample`` or no ``devices``, or what ``given`` holds cannot be planned;
            :class:`pipe.plan.PlanError` when nothing fits.
    """
    _check(module, sample, "pipe.plan.planned_pipe", given)
    if not devices:
        raise ValueError("pipe.plan.planned_pipe() needs devices=, one per stage, to know how many stages "
                         "to plan for (e.g. devices=['cuda:0', 'cuda:1'])")
    where = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    # The layers are timed with the threads each CPU partition's worker computes with.
    threads = partition_threads(given.threads, sum(d.type == "cpu" for d in where))
    chosen = _planned("pipe.plan.planned_pipe", given, lambda: plan(module, sample, memory_budget=memory_budget, stages=len(devices),
                                                  device=where[0], threads=threads, **given.restrictions()))
    logger.info("Pipe plan for memory budget %s:\n%s", memory_budget, chosen.table())
    return chosen


def plan_for_ranks(module: Any, sample: Any, memory_budget: Budget, loss_fn: Optional[Callable[..., Any]],
                   target: Any, given: Given, *, mesh: Optional[DeviceMesh] = None, shard: Any = None,
                   device: Optional[torch.device] = None) -> dict[str, Any]:
    """``DistributedPipe``'s arguments from the plan of global rank 0, on every rank (a collective).

    The ranks are those of ``DistributedPipe``'s ``mesh`` (default: one pipeline over the world). With
    data-parallel ranks ("dp_replicate" replicas of the pipeline, each stage sharded over
    "dp_shard" ranks with ``shard``'s ZeRO mode; each pipeline with ``sample`` as its
    mini-batch) the plan is that of the ``pp x dp_replicate x dp_shard`` split (:mod:`pipe.plan.sharding`),
    on the pipelines' mini-batches together: so FSDP's unsharded parameters and gradients, or the averager's
    copies of the gradients, and their collectives are counted. Rank 0 profiles on its ``device`` (the
    ranks' kind of device; default the CPU). Under ZeRO-3 the plan also chooses what FSDP gathers at a time
    (a stage whole, or a layer at a time with its gradients reduced once a step or after each backward)
    unless ``shard`` says (``Shard(unit=...)``; with ``unit="block"`` its ``reduce``); the result's
    ``"shard"`` is ``shard`` with the plan's ``unit`` and ``reduce``.

    Raises:
        ValueError: a mesh with "tp", FSDP in mixed precision (``Shard(mp_policy=...)`` with a
            ``param_dtype`` or ``reduce_dtype``), blocks of one's own (``Shard(blocks=...)``) a layer at a
            time, ``Shard(prefetch=False)`` or ``Shard(reshard_after_backward=False)``, a ``parallelize``
            function, a schedule given as a table or ``virtual_stages`` other than the plan's, which the
            planner does not model (every rank raises alike); a mesh that does not fit
            (:func:`pipe.distributed.mesh.verify_mesh`).
    """
    if mesh is not None:
        verify_mesh(mesh, torch.device(device) if device is not None
                    else torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        ranks, shards, replicas = mesh_size(mesh, "pp"), mesh_size(mesh, "dp_shard"), mesh_size(mesh, "dp_replicate")
        tensor_parallel = mesh_size(mesh, "tp")
        sharding = verify_shard(shard, mesh)
        units, reduces = _planned_units(sharding, explicit=shard is not None)
        zero3 = sharding is None or sharding.reshard_after_forward
    else:
        replicas, shards, tensor_parallel, zero3, sharding = 1, 1, 1, True, None
        units, reduces = UNITS, REDUCES
        ranks = dist.get_world_size()
    policy = sharding.mp_policy if sharding is not None else None
    if policy is not None and (policy.param_dtype is not None or policy.reduce_dtype is not None):
        raise ValueError(
            f"pipe.plan.planned_distributed() plans in the parameters' own precision, but "
            f"shard=Shard(mp_policy=...) has FSDP gather and compute in {policy.param_dtype} and reduce in "
            f"{policy.reduce_dtype}, whose bytes and times it would not count; leave mp_policy out, or plan "
            f"without it (in full precision) and pass the plan's chunks=, balance= and checkpoint= yourself")
    if given.parallelize is not None:
        raise ValueError(
            f"pipe.plan.planned_distributed() plans the stages as the model builds them, but "
            f"parallelize={getattr(given.parallelize, '__name__', given.parallelize)!r} changes them after the "
            f"plan, in ways it cannot count; leave parallelize= out, or plan with pipe.plan.plan() and pass its "
            f"arguments yourself")
    if tensor_parallel > 1:
        raise ValueError(
            f"pipe.plan.planned_distributed() does not plan tensor parallelism, but the mesh splits each "
            f"stage over tp={tensor_parallel} ranks, whose memory and collectives it would not count; pass "
            f"chunks=, balance= and checkpoint= yourself (plan the mesh without 'tp' to start from: "
            f"pipe.plan.plan(..., dp_shard=...), docs/planner.md)")
    if given.schedule is not None and not isinstance(given.schedule, str):
        raise ValueError(
            f"pipe.plan.planned_distributed() plans the built-in schedules, not a schedule given as a "
            f"table ({type(given.schedule).__name__}); pass schedule= by name (\"gpipe\", \"1f1b\", "
            f"\"interleaved\", \"zb-h1\", \"zbv\"; \"auto\" or \"auto-v\": an order the planner builds from "
            f"the costs), or build DistributedPipe yourself, unplanned")
    if given.virtual_stages is not None and given.virtual_stages != (2 if given.schedule in ("interleaved", "zbv")
                                                                     else 1):
        raise ValueError(
            f"pipe.plan.planned_distributed() plans 2 virtual stages per rank for \"interleaved\" and "
            f"\"zbv\" and 1 otherwise, got virtual_stages={given.virtual_stages} with schedule="
            f"{given.schedule or 'the plan'!r}; leave virtual_stages= out, or build DistributedPipe yourself, unplanned")
    _check(module, sample, "pipe.plan.planned_distributed", given)
    if any(p.is_meta for p in module.parameters()):
        raise ValueError("pipe.plan.planned_distributed() must run the model to measure it; build it on a "
                         "real device, not on torch.device('meta')")

    def decide() -> dict[str, Any]:
        parts = replicas * shards  # pipelines, each with its sample: planned together
        planned_sample, planned_target = sample, target
        if parts > 1:
            from pipe.core.microbatch import Batch, gather

            planned_sample, planned_target = (gather([Batch(value)] * parts) if value is not None else None
                                              for value in (sample, target))
        chosen = _planned("pipe.plan.planned_distributed", given, lambda: plan(
            module, planned_sample, memory_budget=memory_budget, stages=ranks * parts, runner="processes",
            link="cached", loss_fn=loss_fn, target=planned_target, device=device,
            threads=torch.get_num_threads(),  # as this rank, and so every rank, computes
            dp_replicate=[replicas] if replicas > 1 else None, dp_shard=[shards] if shards > 1 else None,
            zero=(3,) if zero3 else (2,), units=units, reduces=reduces, **given.restrictions(parts)))
        logger.info("DistributedPipe plan for memory budget %s:\n%s", memory_budget, chosen.table())
        return chosen.distributed_kwargs()

    planned = dict(decided_on_rank_0(decide))
    if sharding is not None and "shard" in planned:  # the caller's settings (blocks, ...), gathering as planned
        planned["shard"] = replace(sharding, unit=planned["shard"].unit, reduce=planned["shard"].reduce)
    return planned


def _planned_units(sharding: Optional[Shard], explicit: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What FSDP may gather at a time (``Shard(unit=...)``) and when it may reduce (``reduce=``) in the plans
    weighed for ``sharding``: what it says, else all that the planner counts (:mod:`pipe.plan.sharding`).
    ``explicit``: ``Shard(...)`` was given, so a ``reduce`` other than its default holds (and with
    ``unit="block"`` its ``reduce`` does).

    Raises:
        ValueError: settings the planner does not count: ``prefetch=False``, ``reshard_after_backward=False``,
            or blocks of one's own (``blocks=``) gathered a layer at a time.
    """
    if sharding is None:
        return UNITS, REDUCES
    unplanned = [f"{name}=False" for name in ("prefetch", "reshard_after_backward") if not getattr(sharding, name)]
    if unplanned:
        raise ValueError(
            f"pipe.plan.planned_distributed() plans FSDP gathering a layer at a time with the next one prefetched "
            f"and each freed after its backward, but shard=Shard({', '.join(unplanned)}) does otherwise, which it "
            f"does not count; leave {', '.join(u.split('=')[0] + '=' for u in unplanned)} out, or build "
            f"DistributedPipe(..., shard=Shard({', '.join(unplanned)})) yourself with a plan's chunks=, balance= "
            f"and checkpoint= (docs/planner.md)")
    if sharding.blocks is not None:
        if sharding.unit == "block" or sharding.reduce != "step":
            raise ValueError(
                "pipe.plan.planned_distributed() counts FSDP gathering the default blocks a layer at a time (each "
                "layer of a stage), but shard=Shard(blocks=...) chooses its own; leave blocks= out, or pass "
                "Shard(blocks=..., unit='stage') to plan the stages gathered whole")
        return ("stage",), ("step",)
    units = ((sharding.unit,) if sharding.unit is not None else ("block",) if sharding.reduce == "micro-batch"
             else UNITS)
    given = explicit and (sharding.reduce != "step" or sharding.unit == "block")
    return units, (sharding.reduce,) if given else REDUCES


def planned_pipe(module: nn.Sequential, sample: Any, *, memory_budget: Budget, devices: Sequence[Device],
                 chunks: Optional[int] = None, checkpoint: Optional[str] = None, balance: Optional[Sequence[int]] = None,
                 recompute: Optional[ConfigSource] = None, cpu_threads: Optional[int] = None,
                 compile: CompileOption = False, **options: Any) -> Pipe:
    """``Pipe(module, ...)`` with the fastest plan predicted to fit ``memory_budget`` on every device.

    Usage::

        model = pipe.plan.planned_pipe(model, sample, memory_budget="2GiB", devices=["cuda:0", "cuda:1"])
        print(model.plan.table())             # the plan it runs, the runners-up, the rejected

    Measures ``module`` on ``sample`` (:func:`pipe.plan.plan`, GPipe over ``devices``, one stage
    each) and builds the ``Pipe`` with the plan's ``chunks``, ``balance``, ``checkpoint`` and per-stage
    recompute; the plan is its ``.plan``.

    Args:
        module: the ``nn.Sequential`` to plan and wrap.
        sample: one mini-batch, as the pipeline will get it.
        memory_budget: bytes per device (``"2GiB"``, a number, or one per device).
        devices: one device per stage.
        chunks, checkpoint: kept if given (the plan is the fastest with them); else the plan's.
        balance, recompute: refused (the plan chooses them, and its peaks hold for its own choice).
        cpu_threads, compile, options: passed to ``Pipe`` (the layers are timed with ``cpu_threads``
            threads; compiled layers are planned as they run eager, with a warning).

    Raises:
        ValueError: no ``sample`` or ``devices``, or what is given cannot be planned;
            :class:`pipe.plan.PlanError` when nothing fits.
    """
    compiled = verify_compile(compile) is not None
    given = Given(balance=balance, recompute=recompute, compiled=compiled, chunks=chunks, checkpoint=checkpoint,
                  threads=cpu_threads)
    chosen = plan_for_pipe(module, sample, memory_budget, devices, given)
    built = Pipe(module, devices=devices, cpu_threads=cpu_threads, compile=compile, **chosen.pipe_kwargs(), **options)
    built.plan = chosen
    return built


def planned_distributed(model: nn.Sequential, sample: Any, *, memory_budget: Budget, target: Any = None,
                        loss_fn: Optional[Callable[..., Any]] = None, chunks: Optional[int] = None,
                        checkpoint: Optional[str] = None, schedule: Any = None,
                        virtual_stages: Optional[int] = None, balance: Optional[Sequence[int]] = None,
                        recompute: Optional[ConfigSource] = None, parallelize: Any = None,
                        mesh: Optional[DeviceMesh] = None, shard: Optional[Shard] = None,
                        device: Optional[torch.device] = None, compile: CompileOption = False,
                        **options: Any) -> DistributedPipe:
    """``DistributedPipe(model, ...)`` with the fastest plan predicted to fit ``memory_budget`` on every rank.

    A collective: every rank calls it alike. Rank 0 measures ``model`` on ``sample`` (with ``loss_fn``
    and ``target``), plans and broadcasts its choice, and every rank builds the ``DistributedPipe``
    with the plan's chunks, balance, checkpoint mode, schedule, virtual stages and per-stage recompute.
    On a ``mesh`` with "dp_replicate" or "dp_shard", the replicas' and
    FSDP's bytes and collectives are planned too (:mod:`pipe.plan.sharding`); ``sample`` is one
    pipeline's mini-batch.

    Usage::

        model = pipe.plan.planned_distributed(model, x, memory_budget="2GiB", target=y, loss_fn=F.mse_loss)

    Args:
        chunks, checkpoint, schedule, virtual_stages: kept if given (the plan is the fastest with them).
        balance, recompute, parallelize: refused, as are a mesh with "tp", FSDP's mixed precision and a
            schedule given as a table, which the planner does not count.
        shard: as for ``DistributedPipe``; under ZeRO-3 the plan chooses its ``unit`` (and, a layer at a
            time, its ``reduce``) unless given; ``prefetch=False`` and ``reshard_after_backward=False`` are
            refused, since the planner does not count them.
        target, loss_fn, mesh, device, compile, options: as for ``DistributedPipe``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: what is given cannot be planned (every rank raises alike); :class:`pipe.plan.PlanError`
            when nothing fits.
    """
    require_initialized()
    given = Given(balance=balance, recompute=recompute, compiled=verify_compile(compile) is not None,
                  parallelize=parallelize, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                  virtual_stages=virtual_stages)
    planned = plan_for_ranks(model, sample, memory_budget, loss_fn, target, given, mesh=mesh,
                             shard=shard, device=rank_device(device))
    return DistributedPipe(model, planned["chunks"], planned["checkpoint"], schedule=planned["schedule"],
                           balance=planned["balance"], virtual_stages=planned["virtual_stages"],
                           recompute=planned.get("recompute"), loss_fn=loss_fn, mesh=mesh,
                           shard=planned.get("shard", shard), device=device, compile=compile, **options)
