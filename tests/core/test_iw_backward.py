"""Tests for pipe.core.iw_backward: I then W equal one fused backward, W re-runs no input gradient,
and a checkpointed cell is replayed once for both halves."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipe
from pipe.core.checkpoint import Checkpointing
from pipe.core.microbatch import Batch
from pipe.core.iw_backward import IWBackward, backward_input_first


class CountBackward(torch.autograd.Function):
    """Identity that counts how often autograd runs its backward (a node on the input path)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        CountBackward.calls += 1
        return grad


class Count(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return CountBackward.apply(x)


class Tied(nn.Module):
    """Uses one weight twice, at two depths: its gradient has two branches, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.tanh(self.linear(x)))


def models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(8, 16), Count(), nn.LayerNorm(16), nn.GELU(), Count(), nn.Linear(16, 8), Count()),
        nn.Sequential(Tied(), Count(), nn.Linear(8, 8)),
        nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), Count()),
    ]


def _input(model: nn.Module, requires_grad: bool) -> Tensor:
    shape = (4, 8, 5) if isinstance(model[0], nn.Conv1d) else (4, 8)  # type: ignore[index]
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).requires_grad_(requires_grad)


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_input_then_weight_equals_fused_backward(index: int, input_needs_grad: bool) -> None:
    model = models()[index]
    reference = copy.deepcopy(model)
    x, x_ref = _input(model, input_needs_grad), _input(model, input_needs_grad)
    out_ref = reference(x_ref)
    grad = torch.randn_like(out_ref)
    CountBackward.calls = 0
    out_ref.backward(grad)
    fused_calls = CountBackward.calls

    CountBackward.calls = 0
    split = IWBackward([model(x)], [grad], [x], list(model.parameters()))
    input_grads = split.backward_input()
    assert all(p.grad is None for p in model.parameters())  # I computed no weight gradient
    after_input = CountBackward.calls
    split.backward_weight()
    if input_needs_grad:
        # W starts where the weights hang off the input path: it re-runs no input-path node.
        assert after_input == fused_calls and CountBackward.calls == after_input
    else:
        # No input gradient: I is empty and W is the whole backward, once.
        assert after_input == 0 and CountBackward.calls == fused_calls
    if input_needs_grad:
        torch.testing.assert_close(input_grads[0], x_ref.grad)
    else:
        assert input_grads == [None]
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m: f"{name}: {m}")


def test_weight_accumulates_into_existing_grads() -> None:
    model = nn.Linear(4, 4)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    x = torch.randn(3, 4, requires_grad=True)
    reference(x.detach().requires_grad_()).sum().backward()
    split = IWBackward([model(x).sum()], None, [x], list(model.parameters()))
    split.backward_input()
    split.backward_weight()
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)


def test_order_is_enforced() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    layer = nn.Linear(2, 2)
    split = IWBackward([layer(x).sum()], None, [x], list(layer.parameters()))
    with pytest.raises(RuntimeError, match=r"backward_weight\(\) needs backward_input\(\) first"):
        split.backward_weight()
    split.backward_input()
    with pytest.raises(RuntimeError, match=r"backward_input\(\) ran already"):
        split.backward_input()


class Recorded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6))
        self.recomputes = 0

    def forward(self, x: Tensor) -> Tensor:
        self.recomputes += pipe.is_recomputing()
        return self.body(x)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("with_loss", [False, True])
def test_checkpointed_cell_is_replayed_once_for_i_and_w(with_loss: bool, ahead: bool) -> None:
    # torch's split would replay a checkpointed block of 4 Linears once for I and once per W group.
    torch.manual_seed(3)
    model = Recorded()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6)
    torch.manual_seed(9)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    grad = torch.randn_like(out_ref)
    (out_ref.pow(2).sum() if with_loss else out_ref).backward(None if with_loss else grad)

    torch.manual_seed(9)  # the same dropout mask: the checkpoint saves and restores this state
    record = Checkpointing(lambda b: Batch(model(b.value)), Batch(x.clone().requires_grad_()))
    output = record.checkpoint()
    assert model.recomputes == 0
    loss = output.tensor.pow(2).sum() if with_loss else None
    if ahead:  # the process runner replays before the gradient arrives; backward_input_first then reuses it
        record.recompute_ahead()
        assert model.recomputes == 1
    split, leaves = backward_input_first(output.tensors, [grad], [], list(model.parameters()), record, loss)
    assert model.recomputes == 1
    (input_grad,) = split.backward_input()
    split.backward_weight()
    assert model.recomputes == 1  # W used the graph of the one replay
    torch.testing.assert_close(input_grad, x_ref.grad)
    assert leaves[0].shape == x.shape
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)
