"""Offload with prefetch: saved activations to host memory and back, in order."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from recompute_models import assert_same_as_plain, blocks, kept_bytes, sample
from torch import nn

from pipe.core.checkpoint import Checkpointing
from pipe.core.microbatch import Batch
from pipe.recompute import Offloader, offload


def offloaded(model: nn.Module, prefetch: int = 1, **kwargs: object) -> Offloader:
    offloader = Offloader(prefetch, min_bytes=0, record_events=True)
    for layer in model:
        offload(layer, offloader, **kwargs)  # type: ignore[arg-type]
    return offloader


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gradients_are_those_of_the_plain_model(prefetch: int) -> None:
    assert_same_as_plain(blocks(dropout=0.5), lambda m: offloaded(m, prefetch), sample())


def test_prefetch_one_layer_ahead() -> None:
    model = blocks()
    offloader = offloaded(model, 1)
    model(sample()).sum().backward()
    assert offloader.events == [
        ("offload", 0), ("offload", 1), ("offload", 2), ("offload", 3),
        ("fetch", 3), ("use", 3),           # the last layer: nothing could prefetch it
        ("prefetch", 2), ("use", 2),        # while layer 3 runs backward, layer 2 comes back
        ("prefetch", 1), ("use", 1),
        ("prefetch", 0), ("use", 0),
    ]


def test_a_discarded_forward_is_not_prefetched_by_the_next() -> None:
    model = blocks()
    offloader = offloaded(model, 1)
    abandoned = model(sample())  # a warm-up, never backpropagated, its graph still alive
    offloader.discard()
    offloader.events.clear()
    model(sample()).sum().backward()
    assert ("prefetch", 3) not in offloader.events  # the warm-up's last unit, right before the next forward's first
    assert [e for e in offloader.events if e[0] in ("fetch", "prefetch")] == [
        ("fetch", 7), ("prefetch", 6), ("prefetch", 5), ("prefetch", 4)]
    assert offloader.pending_units() == 0
    del abandoned


def test_prefetch_two_layers_ahead_and_on_demand() -> None:
    model = blocks()
    offloader = offloaded(model, 2)
    model(sample()).sum().backward()
    backward = offloader.events[4:]
    assert backward == [("fetch", 3), ("use", 3), ("prefetch", 2), ("prefetch", 1), ("use", 2),
                        ("prefetch", 0), ("use", 1), ("use", 0)]
    model = blocks()
    offloader = offloaded(model, 0)
    model(sample()).sum().backward()
    assert offloader.events[4:] == [e for k in (3, 2, 1, 0) for e in (("fetch", k), ("use", k))]


def test_per_layer_prefetch() -> None:
    model = blocks()
    offloader = Offloader(0, min_bytes=0, record_events=True)
    for k, layer in enumerate(model):
        offload(layer, offloader, backward_prefetch=3 if k == 0 else 0)
    model(sample()).sum().backward()
    assert offloader.events.index(("prefetch", 0)) == offloader.events.index(("use", 3)) + 1


def test_parameters_and_small_tensors_stay() -> None:
    x = sample()
    nothing_model, everything_model = blocks(n=1), blocks(n=1)
    nothing = Offloader(1, min_bytes=10**9)
    offload(nothing_model[0], nothing)
    everything = offloaded(everything_model)
    for model in (nothing_model, everything_model):
        model(x).sum().backward()
    assert nothing.offloaded_bytes == 0
    # Activations only: a copy of a weight would push it above what the plain block keeps.
    assert 0 < everything.offloaded_bytes <= kept_bytes(blocks(n=1), x)


def test_op_swap_offloads_only_the_chosen_submodules() -> None:
    x = sample()
    whole_model, mlp_model = blocks(n=1), blocks(n=1)
    whole = offloaded(whole_model)
    only_mlp = offloaded(mlp_model, names=("mlp",))
    for model in (whole_model, mlp_model):
        model(x).sum().backward()
    assert 0 < only_mlp.offloaded_bytes < whole.offloaded_bytes
    assert_same_as_plain(blocks(n=1), lambda m: offloaded(m, names=("mlp",)), x)


def test_units_are_released_with_the_graph() -> None:
    model = blocks()
    offloader = offloaded(model)
    model(sample()).sum().backward()
    assert offloader.pending_units() == 0
    y = model(sample())
    assert offloader.pending_units() == 4
    del y
    gc.collect()
    assert offloader.pending_units() == 0


def test_checkpoint_boundary_inputs_are_offloaded() -> None:
    # The inputs Checkpointing keeps for Recompute go through the offloader (checkpoint swap).
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    offloader = Offloader(1, min_bytes=0, record_events=True)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2  # not a leaf: a partition boundary inside a pipeline

    def function(batch: Batch) -> Batch:
        return batch.call(layer)

    chk = Checkpointing(function, Batch(h), offload=offloader.hooks("boundary"))
    output = chk.checkpoint()
    chk.recompute(output)
    assert chk.batch.tensors[0].numel() == 0  # the record lets go of the device copy
    output.value.sum().backward()
    expected = copy.deepcopy(layer)
    x2 = x.detach().requires_grad_()
    expected(x2 * 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    assert offloader.events == [("offload", 0), ("fetch", 0), ("use", 0)]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="backward_prefetch must be an int >= 0, got -1"):
        Offloader(-1)
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
        Offloader(1, min_bytes=-5)
    with pytest.raises(ValueError, match="op_swap op_name regex"):
        offload(nn.Linear(1, 1), Offloader(), names=("a(",))


@pytest.mark.cuda
def test_cuda_offload_frees_device_memory_and_keeps_gradients() -> None:
    device = torch.device("cuda")
    plain = blocks(d=256).to(device)
    x = torch.randn(8, 128, 256, device=device, requires_grad=True)
    model = copy.deepcopy(plain)
    offloader = offloaded(model)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = plain(x)
    plain_bytes = torch.cuda.memory_allocated() - base
    y.sum().backward()
    del y
    base = torch.cuda.memory_allocated()
    y = model(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < plain_bytes / 2
    y.sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert offloader.offloaded_bytes > 0
