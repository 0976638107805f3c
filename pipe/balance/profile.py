"""Profiling: the cost of each layer in memory or in parameters, the check that its output size is a fixed
part plus a part per sample, and the sandbox every profile runs in
(its time: :mod:`pipe.balance.timing`).

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
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from pipe.core.inplace import own
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


def backward_from_ones(batch: Batch) -> None:
    """Backward from a gradient of ones into each tensor of ``batch`` that needs one (a stage's step alone)."""
    outputs = [t for t in batch.tensors if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            backward_from_ones(output)  # frees the graph; a later pop may want this layer's skip
            batch = output
    logger.debug("profiled sizes: %s", sizes)
    return sizes


def profile_params(module: nn.Sequential) -> list[int]:
    """The number of parameters of each layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in module]


def check_output_sizes(names: list[str], layers: list[nn.Module], samples: Mapping[int, Any],
                       output_bytes: dict[int, list[int]], device: torch.device) -> None:
    """Checks that each layer's output bytes, measured at the sizes ``samples`` holds (``output_bytes``),
    are a fixed part plus a part per sample (:func:`_check_affine`; a third size is probed where fewer
    were timed).

    Raises:
        RuntimeError: a layer's output is off the line; names the layer.
    """
    _check_affine(names, layers, _with_probe(layers, samples, output_bytes, device))


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
