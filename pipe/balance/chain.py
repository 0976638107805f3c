"""One micro-batch through a chain of layers as a stage runs it, each layer's forward and backward timed.

:func:`run_chain` is the measurement under :mod:`pipe.balance.timing`: every
forward in order, then one backward call shared out to the layers by hooks on
their inputs (or, with ``split``, every I then every W). A layer that raises is
reported as :class:`LayerFailed`, naming its index in the chain.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch import nn

from pipe.balance.clock import Clock
from pipe.balance.profile import detach
from pipe.core.iw_backward import IWBackward
from pipe.core.microbatch import Batch
from pipe.skip.tracker import current_skip_tracker

__all__: list[str] = []


class LayerFailed(Exception):
    """Layer ``layer`` of a chain raised ``cause``."""

    def __init__(self, layer: int, cause: Exception) -> None:
        super().__init__(layer, cause)
        self.layer = layer
        self.cause = cause


def run_chain(layers: Sequence[nn.Module], batch: Batch, device: torch.device, *, split: bool = False,
           connected: bool = True) -> tuple[list[Batch], list[float], list[float], list[float]]:
    """One micro-batch through ``layers`` as a stage runs it, timed per layer: every forward in order,
    then the backward from ones as the last output's gradient, as one call, each layer's share timed
    from the moment its output's gradient is ready to the moment its input's is (hooks on the layers'
    inputs; a backward call per layer cost small layers a call each, which a stage pays once).

    Where some layer's output needs no gradient, no gradient would reach the layers before it, so the
    chain is run again disconnected: each layer on its input detached, with ones as the gradient of
    its own output in a call of its own. With ``split``, the same per layer: every I in reverse order
    (:class:`pipe.core.iw_backward.IWBackward`), then every W.

    Returns:
        Each layer's input and the last layer's output; seconds of each layer's forward, of its
        backward (of its I with ``split``), and of its W (0 without ``split``).

    Raises:
        LayerFailed: a layer failed.
    """
    count = len(layers)
    connected = connected and not split
    clock = Clock(device)
    restore = skips_snapshot()
    given: list[Batch] = []
    outputs: list[Batch] = []
    for k, layer in enumerate(layers):
        if connected and k > 0 and not any(t.requires_grad for t in batch.tensors):
            restore()  # the layers run again: their skips too
            return run_chain(layers, given[0], device, connected=False)
        given.append(batch if connected and k > 0 else detach(batch))
        if connected and k > 0:
            for tensor in given[k].tensors:  # hooked before the layer runs: an in-place layer's stays on its input
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(reached, clock, k))
        try:
            with clock.span(("forward", k)):
                batch = given[k].call(layer)
        except Exception as error:
            raise LayerFailed(k, error) from error
        outputs.append(batch)
    if connected:
        roots = [t for t in batch.tensors if t.requires_grad]
        if roots:
            clock.stamp(("reached", count))
            try:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            except Exception as error:  # in the layer whose output's gradient was the last to be ready
                raise LayerFailed(min(k for k in range(count + 1) if ("reached", k) in clock.stamps) - 1,
                                   error) from error
            clock.stamp(("reached", 0))
        # A layer that returns its input as it is (an identity, a skip's stash) leaves its hook and the next
        # layer's on one tensor, which fire in the order they were registered: its backward is nothing, and
        # its two stamps come out a microsecond apart the wrong way (a negative time the solver refuses).
        backward = [max(0.0, clock.between(("reached", k + 1), ("reached", k))) for k in range(count)]
        return [*given, batch], clock.spans("forward", count), backward, [0.0] * count
    halves: list[tuple[int, IWBackward]] = []
    for k in reversed(range(count)):
        roots = [t for t in outputs[k].tensors if t.requires_grad]
        if not roots:
            continue
        grads = [torch.ones_like(t) for t in roots]
        try:
            if split:
                leaves = [t for t in given[k].tensors if t.requires_grad]
                halves.append((k, IWBackward(roots, grads, leaves, list(layers[k].parameters()))))
            with clock.span(("backward", k)):
                if split:
                    halves[-1][1].backward_input()
                else:
                    torch.autograd.backward(roots, grads)
        except Exception as error:
            raise LayerFailed(k, error) from error
    for k, part in halves:
        with clock.span(("weight", k)):
            part.backward_weight()
    return [*given, batch], clock.spans("forward", count), clock.spans("backward", count), clock.spans("weight", count)


def skips_snapshot() -> Callable[[], None]:
    """A function that puts back the skips stashed now (:mod:`pipe.skip`), for layers about to run again."""
    tracker = current_skip_tracker()
    stashed = dict(tracker.tensors)

    def restore() -> None:
        tracker.tensors = dict(stashed)
    return restore


def reached(clock: Clock, k: int, grad: torch.Tensor) -> None:
    """A hook on layer ``k``'s input: its gradient is ready, layer ``k``'s backward is over."""
    clock.stamp(("reached", k))
