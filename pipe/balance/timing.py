"""Timing layers: each layer's forward and backward (and their I/W halves, and what recompute marks add),
for the time balancer (:func:`profile_times`) and the planner (:func:`time_layers`).

Layers run on copies, in the sandbox of :mod:`pipe.balance.profile`, as a stage runs them: every forward,
then one backward call, shared out to the layers by hooks on their inputs.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from pipe.balance.chain import LayerFailed, run_chain, skips_snapshot
from pipe.balance.clock import Clock
from pipe.balance.profile import as_input, check_output_sizes, detach, layer_copies, sandbox
from pipe.core.iw_backward import IWBackward
from pipe.core.microbatch import Batch

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class LayerTimes:
    """What :func:`time_layers` measured, per micro-batch size (rows) and layer.

    Attributes:
        forward, backward: seconds, the fastest of the timed rounds.
        input_grad, weight_grad: seconds of the input-gradient and the
            weight-gradient halves of each backward (the I and the W of a
            zero-bubble schedule), run apart as the runners run them
            (:class:`pipe.core.iw_backward.IWBackward`): each layer's share of
            its window's I and W (:func:`_shared_out`); empty unless
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
                select: Sequence[str] = (), window: int = 0) -> LayerTimes:
    """Times each layer's forward and backward on copies of the layers, for each sample size.

    The one loop that times layers, for the balancer (:func:`profile_times`)
    and the planner (:func:`pipe.plan.profile.profile_costs`). Layers run as
    a stage runs them (:func:`_chain`): every forward in order, then one
    backward call, each layer's share timed between the moments the gradients
    of its output and of its input are ready; on CUDA timed by events with no
    synchronisation between layers (:class:`pipe.balance.clock.Clock`). (Timed one layer at a
    time, forward then backward, the forwards of a stage of 512-wide
    ``Linear`` layers on 8 rows summed to 1.56-1.88x the stage's own forward
    on the CPU, in a chain 1.10-1.45x: a backward just before leaves the
    caches cold; with a backward call per layer, their backwards summed to
    1.31-1.39x the stage's, in one call 1.12-1.14x;
    ``python benchmarks/planner.py fidelity``.) One untimed round warms up
    (allocations, kernels, autograd threads); then at least ``rounds`` timed
    rounds, and more until ``timeout`` seconds have passed. Each round visits
    every size, so a pause of this process (another one got the core) spoils
    one round of each size, not every round of one size; the fastest round is
    kept, since time lost to other processes is not the layer's cost.

    Args:
        module: the layers (left as they were: copies are timed).
        samples: ``{rows: micro-batch}``, one input per size to time.
        device: where to run.
        rounds: timed rounds at least.
        timeout: keep running rounds until this many seconds have passed.
        split: also time each backward split into I and W
            (:attr:`LayerTimes.input_grad`, :attr:`LayerTimes.weight_grad`):
            each layer alone (forward, then I, then W), then each window as
            one cell, whose halves are shared out in proportion.
        recompute: also time what marking each layer for recompute
            (:func:`pipe.recompute.recompute`) adds to it (:attr:`LayerTimes.replay`),
            as the chain with every layer marked, run right after the plain
            one, takes longer per layer. A layer that fails marked keeps
            its forward as its replay (logged).
        window: layers per stage (0: the whole module as one stage). The
            layers run in windows of this many, each window twice in a row,
            timed the second time, as a stage runs the next micro-batch
            through the layers it holds: their weights still in the caches.
            (Timed in one chain of the whole module, each layer's weights came
            back to a cache the other layers had filled: the planner MLP's
            stage of four 1 MiB weights was profiled at 1.4x its own forward.)

    Raises:
        RuntimeError: a layer failed; the message names it (index and name) and the cause.
    """
    names = [name for name, _ in module.named_children()]
    sizes = list(samples)

    def table() -> dict[int, list[list[float]]]:
        return {rows: [[] for _ in names] for rows in sizes}  # per size and layer: one entry per timed round

    found = {name: table() for name in ("forward", "backward", "input", "weight", "replay", "select", "output_bytes",
                                        "grad_bytes", "cell_input", "cell_weight")}
    needs_grad: list[list[bool]] = [[] for _ in names]
    refused: set[int] = set()  # layers that fail marked for recompute
    failed: set[int] = set()  # layers that fail marked for selective recompute
    done = 0
    with sandbox(device):
        layers = list(layer_copies(module, device))
        selective = [_select_marked(layer, select) for layer in layer_copies(module, device)] if select else []
        begun = time.perf_counter()
        warm = 2 if selective else 1  # untimed rounds: the selective marks plan on their first two calls
        while done < rounds + warm or time.perf_counter() - begun < timeout:
            for rows in sizes:
                try:
                    _time_round(layers, selective, lambda: as_input(samples[rows], device), device, split,
                                recompute, done, {name: table[rows] for name, table in found.items()}, needs_grad,
                                refused, failed, window)
                except LayerFailed as error:
                    layer = layers[error.layer]
                    raise RuntimeError(
                        f"cannot time layer {error.layer} ({names[error.layer]!r}: "
                        f"{type(next(iter(layer.children()), layer)).__name__}) on {rows} rows: "
                        f"{type(error.cause).__name__}: {error.cause}; the layer must run forward and backward "
                        f"on a detached input of a micro-batch") from error.cause
            done += 1
        output_bytes = {rows: [int(t[-1]) for t in per] for rows, per in found["output_bytes"].items()}
        check_output_sizes(names, layers, samples, output_bytes, device)
    logger.debug("timed %d layers at %s rows over %d rounds", len(names), sizes, done - 1)
    fastest = {name: {rows: [min(t) if t else 0.0 for t in per] for rows, per in table.items()}
               for name, table in found.items() if name in ("forward", "backward", "input", "weight")}
    for half in ("input", "weight"):  # each window's fastest split as one cell, shared out
        for rows in sizes:
            fastest[half][rows] = _shared_out(fastest[half][rows], found["cell_" + half][rows], window)
    replay = {rows: [f if k in refused or not found["replay"][rows][k]
                     else max(statistics.median(found["replay"][rows][k]), f)
                     for k, f in enumerate(fastest["forward"][rows])] for rows in sizes} if recompute else {}
    select_replay = {rows: [math.inf if k in failed or not found["select"][rows][k]
                            else max(statistics.median(found["select"][rows][k]), 0.0)
                            for k in range(len(names))] for rows in sizes} if select else {}
    grad_bytes = {rows: [int(t[-1]) for t in per] for rows, per in found["grad_bytes"].items()}
    return LayerTimes(fastest["forward"], fastest["backward"], fastest["input"] if split else {}, output_bytes,
                      done - 1, replay, select_replay, fastest["weight"] if split else {}, needs_grad, grad_bytes)


def _time_round(layers: Sequence[nn.Module], selective: Sequence[nn.Module], sample: Callable[[], Batch],
                device: torch.device, split: bool, recompute: bool, done: int, found: dict[str, list[list[float]]],
                needs_grad: list[list[bool]], refused: set[int], failed: set[int], window: int = 0) -> None:
    """Round ``done`` of :func:`time_layers` at one size (``sample()``: a fresh input): appends to
    ``found``, per layer, the times (from round 1 on; the selective marks' from round 2 on, as they
    plan on their first two calls) and the bytes of its output; sets ``needs_grad``."""
    given, forward, backward = _windows(layers, sample(), device, window)
    # What a recompute mark adds: the same chain with every layer marked, run right after the plain one
    # (paired in the round, so that a slow spell of the machine slows both), each layer's time less its
    # plain time, as a stage runs its marked layers. (Timed per layer alone against a plain run alone,
    # the transformer's replays summed to 1.03-1.08x its stage's on the CPU, in the chain 0.90-1.07x; on an
    # H100, plans with marks profiled alone ran up to 22% faster than predicted.)
    marked = _marked_times(layers, sample, device, window, refused) if recompute else []
    for k, layer in enumerate(layers):
        output = given[k + 1].tensors
        found["output_bytes"][k].append(sum(t.numel() * t.element_size() for t in output))
        found["grad_bytes"][k].append(sum(t.numel() * t.element_size() for t in output if t.requires_grad))
        needs_grad[k] = [t.requires_grad for t in output]
        if done > 0:
            found["forward"][k].append(forward[k])
            found["backward"][k].append(backward[k])
        if done > 0 and marked and k not in refused:
            found["replay"][k].append(marked[k] - forward[k] - backward[k])
        # Alone, each layer then runs plainly, split into I and W (its share of its window's halves below),
        # then marked for selective recompute. What that mark adds is its run less the plain run just
        # before it, paired as above (a difference of the fastest of each, of different rounds, swung by a
        # third between profiles).
        if split:
            _, input_grad, weight_grad = _alone(layer, given[k], device, k, split=True)
            if done > 0:
                found["input"][k].append(input_grad)
                found["weight"][k].append(weight_grad)
        if not selective or k in failed:
            continue
        plain = sum(_alone(layer, given[k], device, k))
        try:
            seconds = sum(_alone(selective[k], given[k], device, k))
        except LayerFailed as error:  # the mark's own limits
            logger.info("layer %d fails marked for selective recompute (%s: %s); it is not planned so", k,
                        type(error.cause).__name__, error.cause)
            failed.add(k)
            continue
        if done >= 2:  # the selective marks plan on their first two calls
            found["select"][k].append(seconds - plain)

    if split and done > 0:  # and each window split as one cell, timed at its first layer
        size = window if window > 0 else max(len(layers), 1)
        for start in range(0, len(layers), size):
            cell = _cell_split(layers[start:start + size], given[start], device)
            if cell is not None:
                found["cell_input"][start].append(cell[0])
                found["cell_weight"][start].append(cell[1])


def _shared_out(alone: list[float], cells: list[list[float]], window: int) -> list[float]:
    """Each layer's share of its window's fastest split as one cell (``cells``: per layer, the cell times
    of the window it begins; empty elsewhere), in proportion to the layers' fastest halves ``alone``;
    a window that could not run as one cell keeps the halves alone.

    A zero-bubble runner splits a stage's backward once, over all its layers
    (:class:`pipe.core.iw_backward.IWBackward`): one I call and one W call per
    stage and micro-batch. Each layer split alone pays those calls' own work
    (planning the walk, hooks, ``autograd.grad``) once per layer: for the
    planner MLP's 512-wide ``Linear`` layers on 16 rows, I and W alone summed
    to 1.6x the backward of their stage (1.2x split as one cell), and its
    zero-bubble plans were predicted 5-10% slow against its others. The
    fastest of each is shared (not each round's shares: a pause in one
    layer's run would shrink the others' shares of that round).
    """
    size = window if window > 0 else max(len(alone), 1)
    shared = list(alone)
    for start in range(0, len(alone), size):
        if not cells[start]:
            continue
        span = range(start, min(start + size, len(alone)))
        whole = math.fsum(alone[k] for k in span)
        for k in span:
            shared[k] = min(cells[start]) * (alone[k] / whole if whole > 0 else 1 / len(span))
    return shared


def _cell_split(layers: Sequence[nn.Module], batch: Batch, device: torch.device) -> tuple[float, float] | None:
    """Seconds of the I and of the W of ``layers`` run as one cell on ``batch``, as a stage's backward is split
    (its input made to need a gradient, as a later stage's does); run twice, timed the second time (the
    weights in the caches, as :func:`_windows` runs them). None where some layer's output needs no gradient."""
    restore = skips_snapshot()
    try:
        for _ in range(2):
            restore()  # the layers run again: their skips too
            clock = Clock(device)
            cell = detach(batch)
            leaves = [t.requires_grad_() for t in cell.tensors if t.is_floating_point() or t.is_complex()]
            for layer in layers:
                cell = cell.call(layer)
                if not any(t.requires_grad for t in cell.tensors):
                    return None
            roots = [t for t in cell.tensors if t.requires_grad]
            split = IWBackward(roots, [torch.ones_like(t) for t in roots], leaves,
                               [p for layer in layers for p in layer.parameters()])
            with clock.span(("input", 0)):
                split.backward_input()
            with clock.span(("weight", 0)):
                split.backward_weight()
        return clock.spans("input", 1)[0], clock.spans("weight", 1)[0]
    finally:
        restore()


def _marked_times(layers: Sequence[nn.Module], sample: Callable[[], Batch], device: torch.device, window: int,
                  refused: set[int]) -> list[float]:
    """Forward plus backward seconds of each layer in :func:`_windows` with every layer marked for recompute
    (:func:`pipe.recompute.recompute`) but those in ``refused``; a layer that fails marked joins
    ``refused`` (logged: its replay is taken as its forward) and the chain runs again without its mark."""
    from pipe.recompute.module import recompute as mark_recompute, unmark

    while True:
        for k, layer in enumerate(layers):
            if k not in refused:
                mark_recompute(layer)
        try:
            _, forward, backward = _windows(layers, sample(), device, window)
            return [f + b for f, b in zip(forward, backward)]
        except LayerFailed as error:  # the mark's own limits: the plain chain ran
            if error.layer in refused:
                raise
            logger.info("layer %d fails marked for recompute (%s: %s); its replay is taken as its forward",
                        error.layer, type(error.cause).__name__, error.cause)
            refused.add(error.layer)
        finally:
            for layer in layers:
                unmark(layer)


def _windows(layers: Sequence[nn.Module], batch: Batch, device: torch.device, window: int
             ) -> tuple[list[Batch], list[float], list[float]]:
    """:func:`_chain` over windows of ``window`` layers in turn (0: all the layers in one), each its forward
    then its backward, as a stage of that many layers runs them, the next window taking the last output;
    the inputs of the layers and the last output, each layer's forward and backward seconds."""
    size = window if window > 0 else max(len(layers), 1)
    given: list[Batch] = []
    forward: list[float] = []
    backward: list[float] = []
    for start in range(0, len(layers), size):
        try:
            if window > 0:  # once untimed: a stage's next micro-batch finds its weights in the caches
                restore = skips_snapshot()
                run_chain(layers[start:start + size], batch, device)
                restore()  # the timed pass pops and stashes the skips again
            inputs, f, b, _ = run_chain(layers[start:start + size], batch, device)
        except LayerFailed as error:
            raise LayerFailed(start + error.layer, error.cause) from error.cause
        given += inputs[:-1]
        forward += f
        backward += b
        batch = inputs[-1]
    return [*given, batch], forward, backward


def _alone(layer: nn.Module, batch: Batch, device: torch.device, k: int,
           split: bool = False) -> tuple[float, float, float]:
    """Seconds of layer ``k`` run alone on ``batch``: its forward, its backward (its I with ``split``) and
    its W (0 without ``split``).

    Raises:
        LayerFailed: the layer failed (named ``k``).
    """
    try:
        _, forward, backward, weight = run_chain([layer], batch, device, split=split)
    except LayerFailed as error:
        raise LayerFailed(k, error.cause) from error.cause
    return forward[0], backward[0], weight[0]


def _select_marked(container: nn.Module, names: Sequence[str]) -> nn.Module:
    """``container``'s layer marked for selective recompute with ``names``, quietly: a layer
    where they choose nothing is a finding of the profile, not the user's typo. The mark stays
    (it plans on its first two calls), so these are copies of their own."""
    from pipe.recompute.module import mark
    from pipe.recompute.selective import SelectiveRecompute, Usage

    layer = next(iter(container.children()), container)
    mark(layer, SelectiveRecompute(layer, names, (), usage=Usage(warn=False)))
    return container


def profile_times(module: nn.Sequential, sample: Any, timeout: float, device: torch.device,
                  window: int = 0) -> list[float]:
    """Seconds of forward plus backward of each layer: the fastest of the rounds run for ``timeout`` seconds
    (``window``: layers per stage, :func:`time_layers`).

    A first, untimed round warms up; at least three timed rounds follow, whatever the timeout.
    """
    measured = time_layers(module, {0: sample}, device, rounds=3, timeout=timeout, window=window)
    times = measured.total(0)
    logger.debug("profiled times over %d rounds: %s", measured.rounds, times)
    return times
