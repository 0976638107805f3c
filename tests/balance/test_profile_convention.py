"""The balancers profile a PipeSequential with its calling convention: layers taking ``(x, mask)``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from helpers import fake_layer_clock, ticking
from pipe import Pipe, PipeSequential
from pipe.balance import balance_by_params, balance_by_size, balance_by_time


class Masked(nn.Module):
    """``(x, mask)`` -> ``(inner(x) * mask, mask)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return self.inner(x) * mask, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.linear(x * mask)


def heavy_model() -> PipeSequential:
    """Six layers taking ``(x, mask)``; layer 2 costs far more than the others together."""
    torch.manual_seed(0)
    heavy = nn.Sequential(nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 16))
    return PipeSequential(Masked(nn.Linear(16, 16)), Masked(nn.ReLU()), Masked(heavy), Masked(nn.Linear(16, 16)),
                          Masked(nn.Tanh()), Head())


SAMPLE = (torch.randn(64, 16), (torch.rand(64, 1) > 0.2).float())


@pytest.mark.parametrize("balancer", ["time", "size", "params"])
def test_balancers_on_pipe_sequential(balancer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = heavy_model()
    before = [t.clone() for t in model.state_dict().values()]
    if balancer == "time":
        # Timed on the CPU by a fake clock that only the layers move, each charged its cost (the heavy one 30x a
        # light one's): by the wall clock, a stall on a busy machine could outweigh a layer and move the balance.
        clock = fake_layer_clock(monkeypatch)
        for k, layer in enumerate(model):
            ticking(layer, clock, *((30e-3, 60e-3) if k == 2 else (1e-3, 2e-3)))
        balance = balance_by_time(3, model, SAMPLE, timeout=0.01, device="cpu")
    elif balancer == "size":
        balance = balance_by_size(3, model, SAMPLE, chunks=4)
    else:
        balance = balance_by_params(3, model)
    assert balance == [2, 1, 3]
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    assert all(p.grad is None for p in model.parameters())

    # The balance it gives runs, and computes what the PipeSequential computes.
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=4, balance=balance, devices=["cpu"] * 3, cpu_threads=1)
    expected = plain(*SAMPLE)
    output = piped(*SAMPLE)
    torch.testing.assert_close(output, expected)
    expected.square().sum().backward()
    output.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")
    piped.close()
