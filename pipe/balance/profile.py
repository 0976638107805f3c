"""Profiling: the cost of each layer in time, in memory, or in parameters.

Every profile runs on copies of the layers, one at a time, with the random
generators forked, so the user's module is left exactly as it was: same
parameters, gradients, training flag, BatchNorm statistics and random state.
Layers run in training mode on a detached input, as a pipeline partition
would run them; the skips of ``@skippable`` layers are handed over detached,
so that each layer's backward stays its own.

Memory is measured the same way on every device, without CUDA's allocator:
the bytes a layer's forward keeps alive are the storages of its output, of
the tensors autograd saved for backward (``saved_tensors_hooks``) and of the
skips it stashed, minus what existed before (its input, parameters and
buffers).
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from pipe.core.inplace import own
from pipe.core.iw_backward import IWBackward
from pipe.core.microbatch import Batch, scatter
from pipe.core.sequential import sequential_like
from pipe.skip.namespace import NamespaceOrNone
from pipe.skip.tracker import SkipTracker, use_skip_tracker
from pipe.core.stream import use_device

__all__: list[str] = []

logger = logging.getLogger(__name__)


class _DetachingTracker(SkipTracker):
    """Hands skips over cut from the stashing layer's graph, and remembers what was stashed."""

    def __init__(self) -> None:
        super().__init__()
        self.stashed: list[Tensor] = []

    def save(self, batch: Batch, ns: NamespaceOrNone, name: str, tensor: Optional[Tensor]) -> None:
        if tensor is not None:
            self.stashed.append(tensor)
            tensor = tensor.detach().requires_grad_(tensor.requires_grad)
        super().save(batch, ns, name, tensor)


def layer_copies(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """A copy of each layer, alone in a container with ``module``'s calling convention."""
    for name, layer in module.named_children():
        layer = copy.deepcopy(layer).to(device)
        layer.train()
        for param in layer.parameters():
            param.grad = None
        yield sequential_like(module, [(name, layer)])


def detach(batch: Batch) -> Batch:
    """The batch cut from its graph, as a stage's received input is."""
    # Owned, as a pipeline's cell input is: an in-place layer may modify it (pipe.core.inplace).
    return own(batch.with_tensors([
        t.detach().requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex()))
        for t in batch.tensors
    ]))


@contextmanager
def sandbox(device: torch.device) -> Iterator[_DetachingTracker]:
    """Where profiled layers run: random state forked, grad on, skips handed over detached."""
    tracker = _DetachingTracker()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.enable_grad(), use_device(device), use_skip_tracker(tracker):
        yield tracker


def as_input(sample: Any, device: torch.device) -> Batch:
    """A copy of ``sample`` on ``device``, as a first stage gets it."""
    batch = Batch(sample)
    # A copy: a first layer that works in place must not modify the caller's sample round after round.
    return detach(batch.with_tensors([t.to(device, copy=True) for t in batch.tensors]))


def _backward(batch: Batch) -> None:
    outputs = [t for t in batch.tensors if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LayerTimes:
    """What :func:`time_layers` measured, per micro-batch size (rows) and layer.

    Attributes:
        forward, backward: seconds, the fastest of the timed rounds.
        input_grad, weight_grad: seconds of the input-gradient and the
            weight-gradient halves of each backward (the I and the W of a
            zero-bubble schedule), run apart as the runners run them
            (:class:`pipe.core.iw_backward.IWBackward`); empty unless
            ``split=True``. Apart they cost more than ``backward`` (a fifth
            more for a transformer block on the CPU): W replays part of the graph.
        output_bytes: bytes of each layer's output.
        grad_bytes: bytes of the tensors of each layer's output that need a
            gradient: what a stage receives back for them (a table made from
            buffers, an integer mask, gets none).
        rounds: timed rounds run.
        replay: seconds that marking each layer for recompute adds to its
            forward and backward (the forward again, and the checkpoint's own
            work), at least its forward; empty unless ``recompute=True``.
        select_replay: seconds that marking each layer for selective recompute
            (:func:`pipe.recompute.select_recompute` with the ``select`` names)
            adds to its forward and backward; ``inf`` for a layer that fails so
            marked; empty unless ``select`` was given.
        needs_grad: whether each tensor of each layer's output requires a
            gradient (a table computed from buffers, such as a saved
            positional table, does not), as a stage receives it.
    """

    forward: dict[int, list[float]]
    backward: dict[int, list[float]]
    input_grad: dict[int, list[float]]
    output_bytes: dict[int, list[int]]
    rounds: int
    replay: dict[int, list[float]] = field(default_factory=dict)
    select_replay: dict[int, list[float]] = field(default_factory=dict)
    weight_grad: dict[int, list[float]] = field(default_factory=dict)
    needs_grad: list[list[bool]] = field(default_factory=list)
    grad_bytes: dict[int, list[int]] = field(default_factory=dict)

    def total(self, rows: int) -> list[float]:
        """Forward plus backward seconds of each layer at ``rows`` rows."""
        return [f + b for f, b in zip(self.forward[rows], self.backward[rows])]


def time_layers(module: nn.Sequential, samples: Mapping[int, Any], device: torch.device, *, rounds: int = 5,
                timeout: float = 0.0, split: bool = False, recompute: bool = False,
                select: Sequence[str] = ()) -> LayerTimes:
    """Times each layer's forward and backward on copies of the layers, for each sample size.

    The one loop that times layers, for the balancer (:func:`profile_times`)
    and the planner (:func:`pipe.plan.profile.profile_costs`): each layer runs
    on a detached input (its own backward only), synchronised before and
    after on CUDA. One untimed round warms up (allocations, kernels, autograd
    threads); then at least ``rounds`` timed rounds, and more until ``timeout``
    seconds have passed. Each round visits every size, so a pause of this
    process (another one got the core) spoils one round of each size, not
    every round of one size; the fastest round is kept, since time lost to
    other processes is not the layer's cost.

    Args:
        module: the layers (left as they were: copies are timed).
        samples: ``{rows: micro-batch}``, one input per size to time.
        device: where to run.
        rounds: timed rounds at least.
        timeout: keep running rounds until this many seconds have passed.
        split: also time each backward split into I and W
            (:attr:`LayerTimes.input_grad`, :attr:`LayerTimes.weight_grad`).
        recompute: also time each layer marked for recompute
            (:func:`pipe.recompute.recompute`), right after it runs plainly in
            the same round (:attr:`LayerTimes.replay`). A layer that fails
            marked keeps its forward as its replay (logged).

    Raises:
        RuntimeError: a layer failed; the message names it (index and name) and the cause.
    """
    names = [name for name, _ in module.named_children()]
    sizes = list(samples)
    forwards = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    backwards = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    inputs = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    weights = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    output_bytes = {rows: [0] * len(names) for rows in sizes}
    needs_grad: list[list[bool]] = [[] for _ in names]
    grad_bytes = {rows: [0] * len(names) for rows in sizes}
    marked = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    refused: set[int] = set()  # layers that fail marked for recompute
    chosen = {rows: [[] for _ in names] for rows in sizes}  # type: dict[int, list[list[float]]]
    failed: set[int] = set()  # layers that fail marked for selective recompute
    done = 0
    with sandbox(device):
        layers = list(layer_copies(module, device))
        selective = [_select_marked(layer, select) for layer in layer_copies(module, device)] if select else []
        begun = time.perf_counter()
        warm = 2 if selective else 1  # untimed rounds: the selective marks plan on their first two calls
        while done < rounds + warm or time.perf_counter() - begun < timeout:
            for rows in sizes:
                batch = as_input(samples[rows], device)
                for k, layer in enumerate(layers):
                    given = batch
                    try:
                        batch = _time_one(layer, detach(given), device, split, done > 0, forwards[rows][k],
                                          backwards[rows][k], inputs[rows][k], weights[rows][k])
                    except Exception as error:
                        raise RuntimeError(f"cannot time layer {k} ({names[k]!r}: {type(next(iter(layer.children()), layer)).__name__}) on "
                                           f"{rows} rows: {type(error).__name__}: {error}; the layer must run "
                                           f"forward and backward on a detached input of a micro-batch") from error
                    output_bytes[rows][k] = sum(t.numel() * t.element_size() for t in batch.tensors)
                    needs_grad[k] = [t.requires_grad for t in batch.tensors]
                    grad_bytes[rows][k] = sum(t.numel() * t.element_size() for t in batch.tensors if t.requires_grad)
                    if recompute and k not in refused:
                        _time_marked(layer, detach(given), device, done > 0, marked[rows][k], refused, k)
                    if selective and k not in failed:
                        _time_marked(selective[k], detach(given), device, done > 1, chosen[rows][k], failed, k,
                                     selective=True)
            done += 1
        _check_affine(names, layers, _with_probe(layers, samples, output_bytes, device))
    logger.debug("timed %d layers at %s rows over %d rounds", len(names), sizes, done - 1)
    forward = {rows: [min(t) for t in per] for rows, per in forwards.items()}
    backward = {rows: [min(t) for t in per] for rows, per in backwards.items()}
    replay = {rows: [f if k in refused else max(_added(marked[rows][k], forwards[rows][k], backwards[rows][k]), f)
                     for k, f in enumerate(forward[rows])] for rows in sizes} if recompute else {}
    select_replay = {rows: [math.inf if k in failed else
                            max(_added(chosen[rows][k], forwards[rows][k], backwards[rows][k]), 0.0)
                            for k in range(len(names))] for rows in sizes} if select else {}
    halves = ({rows: [min(t) for t in per] for rows, per in table.items()} if split else {}
              for table in (inputs, weights))
    input_grad, weight_grad = halves
    return LayerTimes(forward, backward, input_grad, output_bytes, done - 1, replay, select_replay, weight_grad,
                      needs_grad, grad_bytes)


def _added(marked: Sequence[float], forwards: Sequence[float], backwards: Sequence[float]) -> float:
    """Seconds a mark adds to a layer's forward and backward: the median over rounds of the marked run
    less the plain run just before it. Paired in a round, a slow spell of the machine slows both; a
    difference of the fastest of each (of different rounds) swung by a third between profiles."""
    paired = [m - f - b for m, f, b in zip(reversed(marked), reversed(forwards), reversed(backwards))]
    return statistics.median(paired)


def _select_marked(container: nn.Module, names: Sequence[str]) -> nn.Module:
    """``container``'s layer marked for selective recompute with ``names``, quietly: a layer
    where they choose nothing is a finding of the profile, not the user's typo. The mark stays
    (it plans on its first two calls), so these are copies of their own."""
    from pipe.recompute.module import mark
    from pipe.recompute.selective import SelectiveRecompute, Usage

    layer = next(iter(container.children()), container)
    mark(layer, SelectiveRecompute(layer, names, (), usage=Usage(warn=False)))
    return container


def _time_marked(layer: nn.Module, batch: Batch, device: torch.device, timed: bool, times: list[float],
                 refused: set[int], k: int, selective: bool = False) -> None:
    """Runs ``layer`` marked for recompute (marked here, for the run) or for selective recompute
    (marked already), forward then backward; appends the time when ``timed``. A layer that fails so
    marked joins ``refused``."""
    from pipe.recompute.module import recompute, unmark

    if not selective:
        recompute(layer)
    try:
        forwards: list[float] = []
        backwards: list[float] = []
        _time_one(layer, batch, device, False, timed, forwards, backwards, [])
        times.extend(f + b for f, b in zip(forwards, backwards))
    except Exception as error:  # the mark's own limits
        logger.info("layer %d fails marked for %s (%s: %s); %s", k, "selective recompute" if selective else "recompute",
                    type(error).__name__, error,
                    "it is not planned so" if selective else "its replay is taken as its forward")
        refused.add(k)
    finally:
        if not selective:
            unmark(layer)


def _with_probe(layers: list[nn.Module], samples: Mapping[int, Any], output_bytes: dict[int, list[int]],
                device: torch.device) -> dict[int, list[int]]:
    """``output_bytes`` and, where fewer than three sizes were timed, the bytes of each layer's output at one
    more size (a slice of the largest sample, run once without a graph), so that :func:`_check_affine` has
    three points to check a line through."""
    sizes = sorted(rows for rows in output_bytes if rows > 0)
    if len(sizes) >= 3 or not sizes:
        return output_bytes
    largest = sizes[-1]
    probe = next((largest // k for k in range(2, largest + 1) if largest % k == 0 and largest // k not in sizes), 0)
    if not probe:
        return output_bytes
    counted = []
    try:
        with torch.no_grad():
            batch = as_input(scatter(samples[largest], largest // probe)[0].value, device)
            for layer in layers:
                batch = batch.call(layer)
                counted.append(sum(t.numel() * t.element_size() for t in batch.tensors))
    except Exception as error:  # a layer that needs autograd: the planner's own pass without a graph names it
        logger.debug("no probe of output sizes at %d rows (%s: %s)", probe, type(error).__name__, error)
        return output_bytes
    return {**output_bytes, probe: counted}


def _check_affine(names: list[str], layers: list[nn.Module], output_bytes: dict[int, list[int]]) -> None:
    """Each layer's output must be a fixed part plus a part per sample, the same at every size: the
    fixed part holds what does not grow with the micro-batch (a table made from a saved buffer, a mask
    broadcast over the batch). Checked exactly (in integers) on three sizes or more; two sizes fit any line,
    and are only checked for a fixed part and a part per sample that are not negative.

    Raises:
        RuntimeError: a layer's output bytes are off the line (data-dependent shapes: control flow on
            the values, boolean masking), which no per-sample cost can describe; names the layer.
    """
    sizes = sorted(rows for rows in output_bytes if rows > 0)
    if len(sizes) < 2:
        return
    for k, name in enumerate(names):
        (r0, b0), (r1, b1) = ((rows, output_bytes[rows][k]) for rows in sizes[:2])
        # On the line through the first two points, with slope (b1 - b0) / (r1 - r0) and a fixed part >= 0.
        off = b1 < b0 or b0 * (r1 - r0) < r0 * (b1 - b0) or any(
            (output_bytes[rows][k] - b0) * (r1 - r0) != (b1 - b0) * (rows - r0) for rows in sizes[2:])
        if off:
            seen = ", ".join(f"{output_bytes[rows][k]} B at {rows} rows" for rows in sizes)
            raise RuntimeError(
                f"cannot measure layer {k} ({name!r}: {type(next(iter(layers[k].children()), layers[k])).__name__}): "
                f"its output is not a fixed size plus a size per sample ({seen}); its shapes depend on the "
                f"data (control flow on values, boolean masking), so no per-sample cost describes it: plan by "
                f"hand, or keep such a layer's output size fixed")


def _time_one(layer: nn.Module, batch: Batch, device: torch.device, split: bool, timed: bool,
              forwards: list[float], backwards: list[float], inputs: list[float],
              weights: Optional[list[float]] = None) -> Batch:
    """Runs one layer forward then backward; appends the times when ``timed``. With ``split``, a
    second forward's backward runs as I then W (:class:`pipe.core.iw_backward.IWBackward`), as the
    zero-bubble schedules run it, and both halves are timed: apart, they cost more than the backward."""
    synchronize(device)
    tick = time.perf_counter()
    output = batch.call(layer)
    synchronize(device)
    tock = time.perf_counter()
    forward = tock - tick
    roots = [t for t in output.tensors if t.requires_grad]
    grads = [torch.ones_like(t) for t in roots]
    if roots:
        torch.autograd.backward(roots, grads)
    synchronize(device)
    backward = time.perf_counter() - tock
    input_grad = weight_grad = 0.0
    if split and roots:
        again = [t for t in batch.call(layer).tensors if t.requires_grad]
        leaves = [t for t in batch.tensors if t.requires_grad]
        halves = IWBackward(again, grads, leaves, list(layer.parameters()))
        synchronize(device)
        tick = time.perf_counter()
        halves.backward_input()
        synchronize(device)
        tock = time.perf_counter()
        halves.backward_weight()
        synchronize(device)
        input_grad, weight_grad = tock - tick, time.perf_counter() - tock
    if timed:
        forwards.append(forward)
        backwards.append(backward)
        inputs.append(input_grad)
        if weights is not None:
            weights.append(weight_grad)
    return output


def profile_times(module: nn.Sequential, sample: Any, timeout: float, device: torch.device) -> list[float]:
    """Seconds of forward plus backward of each layer: the fastest of the rounds run for ``timeout`` seconds.

    A first, untimed round warms up; at least three timed rounds follow, whatever the timeout.
    """
    measured = time_layers(module, {0: sample}, device, rounds=3, timeout=timeout)
    times = measured.total(0)
    logger.debug("profiled times over %d rounds: %s", measured.rounds, times)
    return times


def _storages(tensors: Any) -> dict[int, int]:
    """``{storage address: bytes}`` of the tensors."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, Tensor) and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def profile_sizes(module: nn.Sequential, sample: Any, chunks: int, param_scale: float,
                  device: torch.device) -> list[int]:
    """Bytes each layer holds for one micro-batch: activations kept for backward, plus
    ``param_scale`` times its parameter bytes."""
    sizes: list[int] = []
    batch = as_input(scatter(sample, chunks)[0].value, device)
    with sandbox(device) as tracker:
        for layer in layer_copies(module, device):
            batch = detach(batch)
            saved: list[Tensor] = []

            def pack(tensor: Tensor) -> Tensor:
                saved.append(tensor)
                return tensor

            tracker.stashed.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = batch.call(layer)
            before = _storages([*batch.tensors, *layer.parameters(), *layer.buffers()])
            kept = _storages([*output.tensors, *saved, *tracker.stashed])
            activations = sum(size for address, size in kept.items() if address not in before)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            sizes.append(int(activations + param_scale * params))
            _backward(output)  # frees the graph; a later pop may want this layer's skip
            batch = output
    logger.debug("profiled sizes: %s", sizes)
    return sizes


def profile_params(module: nn.Sequential) -> list[int]:
    """The number of parameters of each layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in module]
