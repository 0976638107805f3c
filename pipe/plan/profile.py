"""Measuring a model's :class:`pipe.plan.cost.Costs`: per-layer times and per-stage counted bytes.

* **time** is measured per layer (forward and backward timed separately, every
  forward in order and then every backward in reverse, as a stage runs them;
  the fastest of a few rounds, as :mod:`pipe.balance.timing` times layers; the
  backward once more split into I and W as the zero-bubble runners split it;
  once more marked for recompute and once marked for selective recompute:
  what each mark adds);
* **memory** is counted per stage, not estimated: the stage's layers run one
  micro-batch through the very cell the runners use
  (:func:`pipe.core.checkpoint.cell`, checkpointed or not) under
  :class:`pipe.recompute.ActivationMemory`, on the thread that called, so the
  bytes kept for backward and the high-water marks of forward and backward
  are exact on any device; for FSDP gathering a stage a layer at a time, with
  the layers it holds gathered at each moment added
  (:mod:`pipe.plan.block_gathers`). Ranges are measured when first asked for and cached.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from pipe.balance.profile import as_input, backward_from_ones, detach, layer_copies, sandbox, synchronize
from pipe.balance.timing import time_layers
from pipe.core.checkpoint import cell
from pipe.core.inplace import InputGuard
from pipe.core.iw_backward import backward_input_first
from pipe.core.microbatch import Batch, scatter
from pipe.plan.block_gathers import BlockGathers
from pipe.plan.cost import Costs, StageMemory
from pipe.plan.host_copy import HostCopy
from pipe.plan.link import fit_line
from pipe.recompute.memory import ActivationMemory
from pipe.recompute.module import mark, recompute as mark_recompute, unmark
from pipe.recompute.offload import OffloadLayer, Offloader
from pipe.recompute.scope import compile_pattern
from pipe.recompute.defaults import DEFAULT_SELECT
from pipe.recompute.selective import SelectiveRecompute, Usage
from pipe.skip.skippable import skippables_in
from pipe.skip.tracker import partition_function

__all__: list[str] = []

logger = logging.getLogger(__name__)


def verify_threads(threads: Optional[int]) -> None:
    """Raises ValueError unless ``threads`` is None or a positive number of intra-op threads."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be a positive number of intra-op threads, got {threads!r}")


def _layer_inputs(module: nn.Sequential, micro: dict[int, Any], device: torch.device,
                  needs_grad: list[list[bool]]) -> tuple[list[nn.Module], dict[int, list[Batch]]]:
    """Copies of the layers, and the input of every layer for every micro-batch size, computed once
    without a graph (for the memory counts).

    Raises:
        RuntimeError: a layer fails under ``torch.no_grad``; the message names it.
    """
    names = [name for name, _ in module.named_children()]
    with sandbox(device):
        layers = list(layer_copies(module, device))
        inputs: dict[int, list[Batch]] = {}
        with torch.no_grad():
            for rows, value in micro.items():
                batch_ = as_input(value, device)
                inputs[rows] = []
                for k, layer in enumerate(layers):
                    if k:  # a received input needs a gradient where the sender's output did
                        batch_ = batch_.with_tensors([t.requires_grad_(needs) for t, needs
                                                      in zip(batch_.tensors, needs_grad[k - 1])])
                    inputs[rows].append(batch_)
                    try:
                        batch_ = batch_.call(layer)
                    except Exception as error:
                        raise RuntimeError(
                            f"cannot measure layer {k} ({names[k]!r}) under torch.no_grad on {rows} rows: "
                            f"{type(error).__name__}: {error}; pipe.plan runs each layer without a graph to "
                            f"count a stage's bytes: make the layer run under no_grad, or plan by hand") from error
    return layers, inputs


def profile_costs(module: nn.Sequential, sample: Any, chunks: Sequence[int], *, param_scale: float = 2.0,
                  rounds: int = 5, device: Optional[torch.device] = None,
                  loss_fn: Optional[Callable[[Any, Any], Tensor]] = None, target: Any = None,
                  select: Sequence[str] = DEFAULT_SELECT, threads: Optional[int] = None,
                  stages: Optional[int] = None) -> Costs:
    """Measures the costs of ``module`` on ``sample`` (a mini-batch) for each micro-batch count.

    Layers are copied (the module is left as it was, random state included), as
    :mod:`pipe.balance.profile` does; times come from
    :func:`~pipe.balance.timing.time_layers`, with the input-gradient half of
    each backward (for zero-bubble schedules). Only ``chunks`` that divide
    the batch are kept. With ``loss_fn`` and ``target`` (the mini-batch's),
    the last stage's bytes include the loss, as ``DistributedPipe.step``
    computes it; else its backward starts from a gradient of ones.

    Each layer is also timed and counted marked for selective recompute with
    the name regexes ``select`` (:func:`pipe.recompute.select_recompute`;
    default: its ``DEFAULT_SELECT``, the activations and softmax), so that the
    planner can weigh it per stage against full recompute; ``select=()``
    leaves it out. A layer where they choose nothing saves nothing so marked,
    and is never planned with it.

    ``threads``: the intra-op threads the layers are timed with on the CPU
    (``torch.set_num_threads`` while timing; default: this process's), as the
    stages will run: a rank of ``DistributedPipe`` that shares the machine's
    cores with others runs on 1 (torchrun's default for several local ranks).

    ``stages``: the ranks (or partitions) the model will be cut into. The
    layers are then timed in windows of a stage's share of them, each window
    twice in a row (:func:`~pipe.balance.timing.time_layers`'s ``window``),
    since a stage finds its own layers' weights in the caches; default: the
    whole model as one window.

    Raises:
        ValueError: no chunk count divides the batch; several do and the model was split at static sizes
            (``pipe.split(..., dynamic=False)``); stages is not a positive int; the model has skip connections
            (``@skippable`` layers), which the planner does not model yet; a ``select``
            entry is not a valid regex.
        RuntimeError: a layer cannot be measured (it fails, or fails under
            ``torch.no_grad``); the message names the layer.
    """
    device = device or torch.device("cpu")
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise ValueError(f"stages must be a positive int (the ranks the model will be cut into), got {stages!r}")
    if any(True for _ in skippables_in(module)):
        raise ValueError("pipe.plan does not model skip connections (@skippable layers) yet; "
                         "choose balance, chunks and checkpoint by hand for this model")
    batch = scatter(sample, 1)[0].tensors[0].size(0)
    usable = sorted({c for c in chunks if c >= 1 and batch % c == 0})
    if not usable:
        raise ValueError(f"none of chunks={list(chunks)} divides the batch of {batch} samples; "
                         f"pass chunk counts that divide it, such as 1, 2 or {batch}")
    static = next((shapes for m in module.modules() if (shapes := getattr(m, "static_shapes", None))), None)
    if static is not None and len(usable) > 1:
        rows = next(shape[0] for shape in static if shape)
        alone = f", or pass chunks=[{batch // rows}] alone" if batch % rows == 0 else ""
        raise ValueError(
            f"pipe.plan measures every layer at micro-batches of {[batch // c for c in usable]} rows (chunks="
            f"{usable} of the batch of {batch}), but these pieces were captured at static sizes (pipe.split(..., "
            f"dynamic=False): micro-batches of {rows} rows), which run at that one shape only: split with "
            f"dynamic=True (the default) to plan{alone}")
    micro = {batch // c: scatter(sample, c)[0].value for c in usable}
    if loss_fn is not None and target is None:
        raise ValueError("profile_costs(loss_fn=...) needs target=, the mini-batch's targets, to compute the loss")
    targets = {batch // c: as_input(scatter(target, c)[0].value, device).value for c in usable} \
        if loss_fn is not None else {}
    begun = time.perf_counter()
    select = (select,) if isinstance(select, str) else tuple(select)
    for pattern in select:
        compile_pattern(pattern, "profile_costs(select=...)")
    verify_threads(threads)
    before = torch.get_num_threads()
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        times = time_layers(module, micro, device, rounds=rounds, split=True, recompute=True, select=select,
                            window=-(-len(module) // stages) if stages else 0)
        layers, inputs = _layer_inputs(module, micro, device, times.needs_grad)
        first_stage = nn.Sequential(*layers[:-(-len(module) // stages) if stages else len(module)])
        with sandbox(device):
            # The checkpoint's own work is per call (the random state, the input's guard, its autograd
            # functions), not per row: one figure, the median of the sizes', steadier than each alone.
            overhead = statistics.median(_checkpoint_overhead(first_stage, given[0], device) for given in inputs.values())
        moved, copies = _offload_moves(layers, inputs, device)
        host_copy = measure_host_copy(device) if device.type == "cuda" else None  # the CPU saves nothing offloading
    finally:
        torch.set_num_threads(before)
    for layer in layers:  # gradients exist before counting: they are static, not activations
        for param in layer.parameters():
            param.grad = torch.zeros_like(param)
    logger.debug("profiled layer times in %.2f s", time.perf_counter() - begun)

    def memory(first: int, stop: int, rows: int, checkpointed: bool, recomputed: int, split: bool,
               fresh: bool = False, selected: int = 0, offloaded: int = 0, prefetch: int = 1,
               blocks: str = "") -> StageMemory:
        stage = layers[first:stop]
        for layer in stage[:recomputed]:
            mark_recompute(layer)
        chosen = [next(iter(layer.children()), layer) for layer in stage[recomputed:selected]]
        for layer in chosen:  # the layer itself, as a recompute config marks it (its names are the patterns')
            mark(layer, SelectiveRecompute(layer, select, (), usage=Usage(warn=False)))
        offloader = Offloader(backward_prefetch=max(prefetch, 0))  # as a swap config's layer_swap marks them
        for layer in stage[:offloaded]:  # the host copies are not counted: what stays on the device is
            mark(layer, OffloadLayer(layer, offloader))
        try:
            with sandbox(device):
                if chosen:  # the marks plan on their first two calls (the second where they narrow)
                    _warm_up(nn.Sequential(*stage), inputs[rows][first], first == 0, calls=2)
                loss = (loss_fn, targets[rows]) if loss_fn is not None and stop == len(layers) else None
                # The first stage gets a micro-batch of a fresh copy of the mini-batch, a view, as the runners give
                # it: a layer working in place changes no later count, and an offloader moves the whole storage.
                given = scatter(as_input(sample, device).value, batch // rows)[0] if first == 0 else inputs[rows][first]
                return _count_stage(nn.Sequential(*stage), given, first == 0, checkpointed, loss,
                                    split, fresh, offloader if offloaded else None, prefetch < 0, blocks)
        finally:
            for layer in [*stage[:recomputed], *chosen, *stage[:offloaded]]:
                unmark(layer)

    param_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module]
    holders: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for k, layer in enumerate(module):
        for p in layer.parameters():
            holders.setdefault(id(p), []).append(k)
            sizes[id(p)] = p.numel() * p.element_size()
    tied = [(layers, sizes[key]) for key, layers in holders.items() if len(layers) > 1]  # a tied weight: held once
    return Costs(batch, _monotone(times.forward), _monotone(times.backward), memory, param_bytes, tied=tied,
                 param_scale=param_scale, output_bytes=times.output_bytes,
                 grad_bytes=times.grad_bytes, input_grad=_monotone(times.input_grad),
                 weight_grad=_monotone(times.weight_grad),
                 replay=_monotone(times.replay), select_replay=_monotone(times.select_replay) if select else None,
                 select=select, checkpoint_overhead=overhead, offload_bytes=moved, offload_copies=copies,
                 host_copy=host_copy)


def _offload_moves(layers: list[nn.Module], inputs: dict[int, list[Batch]], device: torch.device
                   ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The bytes, and the copies, that each layer's offloader unit moves to host memory (and back) for a
    micro-batch of each size: each layer run once on its input, as inside an offloading stage.

    A layer's input is given as a tensor made inside the stage (a received one, a leaf that needs a
    gradient, stays on the device): a stage's first layer is charged for its input, were it saved,
    where its received input stays, so its copies are over-estimated by that much.
    """
    moved: dict[int, list[int]] = {}
    copies: dict[int, list[int]] = {}
    with sandbox(device):
        for rows, given in inputs.items():
            moved[rows], copies[rows] = [], []
            for layer, batch in zip(layers, given):
                offloader = Offloader(backward_prefetch=0)
                inside = batch.with_tensors([t.clone() if t.requires_grad else t for t in batch.tensors])
                with offloader.unit():
                    output = inside.call(layer)
                moved[rows].append(offloader.offloaded_bytes)
                copies[rows].append(offloader.offloaded_copies)
                del output, inside
    return moved, copies


def _checkpoint_overhead(stage: nn.Sequential, given: Batch, device: torch.device, rounds: int = 20) -> float:
    """Seconds a checkpointed cell of ``stage`` (the first stage, on its micro-batch ``given``) adds to a
    step beyond its layers' forwards again: the checkpoint's own work.

    The cell runs plain and checkpointed in turn, forward then backward, as a runner runs it, ``rounds``
    times; on the footing of the layer times (the fastest of rounds), the fastest checkpointed run less
    the fastest plain run and the fastest plain forward, at least 0. (On the CPU, for a stage of 8 small
    layers on 8 rows: 0.6-1.1 ms against a forward of 0.75-0.97 ms, four trials of 30 rounds; in the
    planner benchmark's profiles 0-0.6 ms from one size to the next, hence one figure over the sizes.)
    """
    function = partition_function(stage)
    guard = InputGuard("the profiled stage", shared=True, partition=stage)
    guard.call(function, detach(given.with_tensors([t.clone() for t in given.tensors])))

    def run(checkpointed: bool) -> tuple[float, float]:
        batch = detach(given.with_tensors([t.clone() for t in given.tensors]))
        synchronize(device)
        begun = time.perf_counter()
        compute, finalize, _ = cell(function, batch, checkpointed, (0, 0), guard=guard)
        output = compute()
        finalize(output)
        synchronize(device)
        forward = time.perf_counter() - begun
        backward_from_ones(output)
        synchronize(device)
        return forward, time.perf_counter() - begun

    for _ in range(2):  # warm: the checkpointed cell's first calls set up what later calls reuse
        run(False), run(True)
    plain, checkpointed = [], []
    for _ in range(rounds):
        plain.append(run(False))
        checkpointed.append(run(True))
    fastest_forward = min(forward for forward, _ in plain)
    return max(min(total for _, total in checkpointed) - min(total for _, total in plain) - fastest_forward, 0.0)


def _warm_up(stage: nn.Sequential, given: Batch, first: bool, calls: int) -> None:
    """Runs ``stage`` forward and backward ``calls`` times on a copy of ``given`` (gradients accumulate),
    its input needing a gradient as ``given``'s does unless ``first``, as in :func:`_count_stage`."""
    for _ in range(calls):
        tensors = [t.detach().clone().requires_grad_(not first and t.requires_grad) for t in given.tensors]
        backward_from_ones(given.with_tensors(tensors).call(stage))


Table = dict[int, list[float]]


def _monotone(times: Table) -> Table:
    """A layer takes no longer on fewer rows: a slow measurement at a small size (preempted
    in every round) is replaced by the time measured on more rows."""
    sizes = sorted(times, reverse=True)
    result = {sizes[0]: list(times[sizes[0]])}
    for larger, rows in zip(sizes, sizes[1:]):
        result[rows] = [min(t, bound) for t, bound in zip(times[rows], result[larger])]
    return result


def _count_stage(stage: nn.Sequential, given: Batch, first: bool, checkpointed: bool,
                 loss: Optional[tuple[Callable[[Any, Any], Tensor], Any]] = None, split: bool = False,
                 fresh: bool = False, offloader: Optional[Offloader] = None, fetch: bool = False,
                 blocks: str = "") -> StageMemory:
    """Runs one micro-batch through ``stage`` as a runner's cell and counts its bytes; with ``split``,
    its backward runs as I then W (:mod:`pipe.core.iw_backward`), as the zero-bubble schedules run it;
    with ``fresh``, the parameters have no gradient before the backward (it creates them, counted);
    ``offloader``: the one the stage's layers offload through; with ``fetch``, the counted forward's units
    all come back before the backward (counted apart, :attr:`StageMemory.fetched`). ``blocks``: FSDP gathers
    the stage a layer at a time (:class:`pipe.plan.block_gathers.BlockGathers`), reducing its gradients once
    a step (``"step"``) or after each backward (``"micro-batch"``: every backward creates its gradients, and
    frees them; ``fresh`` then means the stage's first backward of the step, before which FSDP holds no
    reduce-scatter input); ``""``: not so (the gathered stage is counted apart, :mod:`pipe.plan.sharding`)."""
    if blocks and (split or offloader is not None):
        raise ValueError(f"blocks={blocks!r}: FSDP gathers a layer at a time only where the backward is whole "
                         f"and nothing offloads (got split={split}, offloading={offloader is not None})")

    function = partition_function(stage)
    # As in the runners' steady state: the stage's guard already knows what it modifies in place
    # (until it knows, a checkpointed cell keeps copies of all its inputs) and which outputs need a gradient.
    guard = InputGuard("the profiled stage", shared=first, partition=stage)
    guard.call(function, detach(given.with_tensors([t.clone() for t in given.tensors])))
    after_input = weight_peak = input_peak = 0
    if offloader is not None:
        offloader.discard()  # the warm-up's units: never used, nor prefetched by the counted ones
    first_backward, fresh = fresh, fresh or blocks == "micro-batch"  # reduced each time, gradients are new
    counter = ActivationMemory()
    gathers = BlockGathers(stage, counter, blocks == "micro-batch", given.tensors[0].device) if blocks else None
    with counter, gathers if gathers is not None else contextlib.nullcontext():
        # A later stage's input arrives (allocated here); the first stage's is a view of the batch.
        # A received input needs its gradient where the sender's output did (it is sent back).
        tensors = [t if first else t.detach().clone().requires_grad_(t.requires_grad) for t in given.tensors]
        batch = detach(given.with_tensors(tensors))
        compute, finalize, record = cell(function, batch, checkpointed, (0, 0), guard=guard)
        output = compute()
        if not split:  # split: I replays a checkpointed cell itself
            finalize(output)
        value = loss[0](output.value, loss[1]) if loss is not None else None
        forward_peak, kept = counter.peak_bytes, counter.live_bytes - (gathers.rest if gathers is not None else 0)
        fetched = 0
        if offloader is not None and fetch:
            offloader.prefetch(None, 0)
            fetched = counter.live_bytes - kept
        counter.reset_peak()
        if gathers is not None and gathers.reduce_each and not first_backward:
            gathers.keep_reduced()
        saved = [(p, p.grad) for p in stage.parameters()] if fresh else []
        for param, _ in saved:
            param.grad = None  # the backward creates them, as at a sharded stage's first backward
        if split:
            outputs = list(output.tensors)
            ones: list[Optional[Tensor]] = [torch.ones_like(t) if t.requires_grad else None for t in outputs]
            halves, _ = backward_input_first(outputs, ones, list(batch.tensors), list(stage.parameters()), record, value)
            del ones, record
            halves.backward_input()
            after_input = counter.live_bytes - kept
            input_peak = counter.peak_bytes  # I's high-water mark; W's is counted apart, from what I left
            before_weight = counter.live_bytes
            counter.reset_peak()
            halves.backward_weight()
            weight_peak = counter.peak_bytes - before_weight
            del halves, outputs
        elif value is not None:
            value.backward()
        else:
            roots = [t for t in output.tensors if t.requires_grad]
            grads: list[Tensor] = [torch.ones_like(t) for t in roots]  # the gradient that arrives
            if roots:
                torch.autograd.backward(roots, grads)
            del roots, grads
        backward_peak = (input_peak if split else counter.peak_bytes) - kept - fetched
        reduces: tuple[tuple[int, int], ...] = ()
        if gathers is not None and gathers.reduce_each:
            points = [*gathers.reduces, (0, counter.peak_bytes)]
            reduces = tuple((nbytes, at - kept - fetched) for nbytes, at in points)
            backward_peak = max(at for _, at in reduces)
        for param, grad in saved:
            param.grad = grad
        del output, value, batch, tensors, saved
    return StageMemory(forward_peak=forward_peak, kept=kept, backward_peak=backward_peak,
                       after_input=max(after_input, 0), weight_peak=max(weight_peak, 0), fetched=fetched,
                       reduces=reduces)


SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
"""Bytes copied each way by :func:`measure_host_copy` (64 KiB to 64 MiB)."""


def measure_host_copy(device: torch.device, sizes: Sequence[int] = SIZES, repeats: int = 8) -> HostCopy:
    """Times copies of ``sizes`` bytes to and from pinned host memory on a side stream of ``device`` (a CUDA
    device), the fastest of ``repeats`` of each (after two to warm up), and fits ``latency + bytes x per_byte``
    to the slower way of each size.

    Raises:
        ValueError: ``device`` is not a CUDA device (the CPU has no host copy to measure).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_host_copy needs a CUDA device, got {device}: on the CPU offloading to host "
                         f"memory saves nothing and costs nothing to plan")
    stream = torch.cuda.Stream(device)
    points: dict[int, float] = {}
    for nbytes in sizes:
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        slowest = 0.0
        for target, source in ((on_host, on_device), (on_device, on_host)):
            times = []
            for k in range(repeats + 2):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    begin.record(stream)
                    target.copy_(source, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                if k >= 2:
                    times.append(begin.elapsed_time(end) / 1000)
            slowest = max(slowest, min(times))
        points[nbytes] = slowest
    latency, per_byte = fit_line(points)
    return HostCopy(latency, per_byte)
