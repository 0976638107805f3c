"""Measurement: what a plan really costs on this rank, to check a prediction against.

Run inside each rank of a ``DistributedPipe``: a first step warms up and
allocates the gradients (two, where layers recompute selectively: their marks
plan on their first two calls, running plainly); then one step is timed and its activation bytes
counted with :class:`pipe.recompute.ActivationMemory` (the rank's forwards and
backwards run on its main thread, so every storage they create is counted).
The static part (parameters, gradients, optimiser state) is the same formula
on both sides, so the comparison is on the activations::

    from pipe.plan.measure import measure_step
    measured = measure_step(model, x, y, loss_fn)
    measured.activation_peak        # counted bytes, this rank
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

import pipe.trace
from pipe.recompute.memory import ActivationMemory
from pipe.recompute.module import policy_of
from pipe.recompute.selective import SelectiveRecompute

if TYPE_CHECKING:  # pragma: no cover
    from pipe.plan.candidate import Candidate
    from pipe.plan.search import Plan

__all__: list[str] = []


@dataclass(frozen=True)
class Measured:
    """One rank's measured step: counted peak (bytes; activations, plus the static bytes in
    :func:`verify_plan`) and wall time (seconds, the fastest timed step); ``pipeline_rank``: its rank in the
    pipeline (its index in a prediction's ``peaks``; a sharded or replicated plan has ``dp_replicate x dp_shard``
    ranks per pipeline rank); ``step_times``: every timed step, in order (over every sweep of
    :func:`run_plans`), how far the machine's speed spread the measurement; ``trace``: with ``record=True``, this
    rank's :func:`pipe.trace.record` of the timed steps (of the sweep with its fastest step), for
    :func:`pipe.balance.traced_step`."""

    activation_peak: int
    step_time: float
    pipeline_rank: int = 0
    step_times: tuple[float, ...] = ()
    trace: Optional[dict[str, Any]] = None


def pipeline_steps(ranks: Sequence[Measured]) -> list[float]:
    """The timed steps of one plan measured on ``ranks`` (one :class:`Measured` each), each as long as its
    slowest rank's."""
    return [max(step) for step in zip(*(m.step_times for m in ranks))]


def mean_output_loss(output: Any, target: Any) -> Any:
    """The loss of a measured step when none is given: the mean of the output's tensors (``target`` unused)."""
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output]) if isinstance(t, torch.Tensor)]
    return sum(t.float().mean() for t in tensors)


def measure_step(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable[..., Any],
                 repeat: int = 3, record: bool = False) -> Measured:
    """Counts and times ``model.step(inputs, target, loss_fn)`` on this rank (every rank must call it).

    The step time is the fastest of ``repeat`` steps; the peak is that of the first counted step,
    after one step of warm-up (two with layers marked for selective recompute, which plan meanwhile).
    ``record``: the timed steps run inside :func:`pipe.trace.record`, kept as the result's ``trace``.
    """
    step = getattr(model, "step", None)
    if step is None:
        raise TypeError(f"measure_step needs a DistributedPipe (a model with step()), got {type(model).__name__}")
    # Every rank runs as many steps: warm up twice if any rank's stages recompute selectively.
    selective = torch.tensor([any(isinstance(policy_of(m), SelectiveRecompute) for m in model.modules())],
                             dtype=torch.int32)
    torch.distributed.all_reduce(selective, op=torch.distributed.ReduceOp.MAX)
    for _ in range(2 if selective.item() else 1):
        step(inputs, target, loss_fn)  # warm-up; allocates .grad
    for param in model.parameters():
        if param.grad is not None:
            param.grad.zero_()
    with ActivationMemory() as counter, _resized_storages(counter):
        step(inputs, target, loss_fn)
        peak = counter.peak_bytes
    times = []
    with pipe.trace.record(None, rank=torch.distributed.get_rank()) if record else contextlib.nullcontext() as recorder:
        for _ in range(repeat):
            begun = time.perf_counter()
            step(inputs, target, loss_fn)
            times.append(time.perf_counter() - begun)
    torch.distributed.barrier()
    return Measured(peak, min(times), step_times=tuple(times), trace=recorder.trace() if recorder is not None else None)


@contextlib.contextmanager
def _resized_storages(counter: ActivationMemory) -> Iterator[None]:
    """Counts the storages FSDP2 resizes in place (its unsharded parameters, gathered and freed by
    ``storage.resize_``, which no dispatched op sees) into ``counter``.

    FSDP2 allocates a parameter's unsharded storage once and then resizes it
    to its full size at each all-gather and to 0 at each reshard; those bytes
    are real but invisible to :class:`ActivationMemory`, so its two helpers
    are wrapped here while a step is counted.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # pragma: no cover - no FSDP2 in this torch: nothing resized
        yield
        return
    modules = [m for m in (_fsdp_param, _fsdp_param_group) if hasattr(m, "alloc_storage")]
    saved = [(m, m.alloc_storage, getattr(m, "free_storage", None)) for m in modules]
    if not hasattr(_fsdp_param, "alloc_storage") or not hasattr(_fsdp_param, "free_storage"):
        raise RuntimeError("this torch's FSDP2 has no alloc_storage/free_storage helpers, so pipe.plan cannot count "
                           "its gathered parameters; measure a sharded plan with the torch version pipe supports")

    def alloc(tensor: Any) -> None:
        before = tensor.untyped_storage().nbytes()
        saved[0][1](tensor)
        counter.adjust(tensor.untyped_storage().nbytes() - before)

    def free(tensor: Any) -> None:
        before = tensor.untyped_storage().nbytes()
        saved[0][2](tensor)  # type: ignore[misc]
        counter.adjust(tensor.untyped_storage().nbytes() - before)

    for module in modules:
        module.alloc_storage = alloc  # type: ignore[attr-defined]
        if hasattr(module, "free_storage"):
            module.free_storage = free  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, alloc_, free_ in saved:
            module.alloc_storage = alloc_  # type: ignore[attr-defined]
            if free_ is not None:
                module.free_storage = free_  # type: ignore[attr-defined]


def _plans_rank(rank: int, world: int, build: Callable[[], nn.Module], candidates: "list[Candidate]",
                inputs: Any, target: Any, loss_fn: Callable[..., Any], repeat: int, sweeps: int,
                tables: "list[Any]", record: bool = False) -> "list[Measured]":
    """One rank of :func:`run_plans` (its process group made by :func:`pipe.distributed.local_ranks.run_local_ranks`)."""
    from pipe.core.microbatch import scatter
    from pipe.distributed import DistributedPipe, make_mesh

    best: list[Measured] = []
    for sweep in range(sweeps):  # the plans in turn, each sweep: a burst of load slows one sweep, not one plan
        for k, candidate in enumerate(candidates):
            kwargs = candidate.distributed_kwargs()
            if tables[k] is not None:  # an order built from the costs ("auto"), as the prediction timed it
                kwargs["schedule"] = tables[k]
            if candidate.parts > 1:
                kwargs = dict(kwargs, mesh=make_mesh(**candidate.mesh_kwargs()))
            torch.manual_seed(0)  # partners start alike (DistributedPipe checks it), whatever build() seeds
            model = DistributedPipe(build(), **kwargs)
            parts, part = model.topology.data_parallel, model.topology.replica
            x, y = inputs, target
            if parts > 1:  # each pipeline of the shard group takes its part of the mini-batch
                x, y = scatter(inputs, parts)[part].value, scatter(target, parts)[part].value
            m = replace(measure_step(model, x, y, loss_fn, repeat=repeat, record=record),
                        pipeline_rank=model.topology.pipeline_rank)
            if sweep == 0:
                best.append(m)
            else:  # the first sweep's peak, the fastest step of all (and the trace of its sweep)
                best[k] = replace(best[k], step_time=min(best[k].step_time, m.step_time),
                                  step_times=best[k].step_times + m.step_times,
                                  trace=m.trace if m.step_time < best[k].step_time else best[k].trace)
    return best


def run_plans(build: Callable[[], nn.Module], candidates: "Sequence[Candidate]", inputs: Any, target: Any,
              loss_fn: Callable[..., Any], *, repeat: int = 3, sweeps: int = 1,
              timeout: float = 300.0, tables: "Optional[Sequence[Any]]" = None,
              record: bool = False) -> "list[list[Measured]]":
    """Runs each of ``candidates`` (runner ``"processes"``, all on as many ranks) on local gloo processes, one
    process per rank, and measures its step (:func:`measure_step`); per candidate, one :class:`Measured` per rank
    (the counted activation peak, without the static bytes).

    A ``pp x dp_replicate x dp_shard`` plan runs on the mesh of ``candidate.mesh_kwargs()``, each pipeline on its part of
    ``inputs`` and ``target``. With ``sweeps > 1`` the candidates run in turn that many times and each keeps
    its fastest step. ``tables``: per candidate, the schedule it runs where it is an order built from the costs
    (``"auto"``: :attr:`pipe.plan.Prediction.schedule`), else None. ``record``: each rank keeps the trace of its
    timed steps (:attr:`Measured.trace`). ``build()`` returns a fresh model. The ranks are started by
    :func:`pipe.distributed.local_ranks.run_local_ranks`: forked (any function works) where no GPU is visible;
    where one is, fresh interpreters, so ``build``, ``loss_fn`` and the data must pickle (a function at module
    level): a child forked from this process can use neither CUDA once this process has, nor autograd once
    this process ran a backward (torch starts autograd's device threads then). The caller's script is never
    run again in the ranks.

    Raises:
        ValueError: no candidates, or candidates on different numbers of ranks.
        RuntimeError: a rank failed (the message says which and why) or took longer than ``timeout`` seconds.
        TypeError: a GPU is visible and ``build``, ``loss_fn`` or the data do not pickle.
    """
    import pickle

    from pipe.distributed.local_ranks import RankFailure, default_start_method, run_local_ranks

    worlds = sorted({c.world for c in candidates})
    if len(worlds) != 1:
        raise ValueError(f"run_plans runs candidates on one set of ranks; got plans on {worlds or 'no'} ranks")
    world = worlds[0]
    if default_start_method() != "fork":  # the ranks get build, loss_fn and the data by pickling
        try:
            pickle.dumps((build, loss_fn, inputs, target))
        except Exception as error:
            raise TypeError(
                f"running a plan: {error}. With a GPU visible the plan's ranks are fresh interpreters (a child "
                "forked from this process cannot use CUDA or autograd after this process did), so build and "
                "loss_fn must be functions at module level and the data must pickle") from None
    try:
        results = run_local_ranks(_plans_rank, world, build, list(candidates), inputs, target, loss_fn, repeat, sweeps,
                                  list(tables) if tables is not None else [None] * len(candidates), record,
                                  timeout=120.0, deadline=timeout)
    except RankFailure as error:
        raise RuntimeError(f"running {len(candidates)} plan(s) on {world} processes failed (or took more than "
                           f"{timeout} s):\n{error}") from None
    return [[results[r][k] for r in range(world)] for k in range(len(candidates))]


def verify_plan(build: Callable[[], nn.Module], plan: "Plan", inputs: Any, target: Any, loss_fn: Callable[..., Any],
                *, repeat: int = 3, timeout: float = 300.0) -> list[Measured]:
    """Runs ``plan`` (runner ``"processes"``) on as many local gloo processes as it has ranks
    (:func:`run_plans`); one :class:`Measured` per rank, the static bytes of the plan's prediction added to the
    counted peak.

    Raises:
        RuntimeError: a rank failed (the message says which and why) or took longer than ``timeout`` seconds.
        TypeError: a GPU is visible and ``build``, ``loss_fn`` or the data do not pickle.
    """
    table = plan.distributed_kwargs()["schedule"]
    measured = run_plans(build, [plan.candidate], inputs, target, loss_fn, repeat=repeat, timeout=timeout,
                         tables=[table if not isinstance(table, str) else None])[0]
    return [replace(m, activation_peak=m.activation_peak + plan.best.static[m.pipeline_rank]) for m in measured]
