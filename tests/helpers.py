"""Helpers shared by the tests."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import pytest

if TYPE_CHECKING:
    from torch import nn

    from pipe.plan import Costs


def without_lowering_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lower schedules afresh for the rest of the test (:mod:`pipe.core.program_time` caches lowered programs
    per schedule): a test that patches what a schedule's actions are must neither time programs lowered
    before the patch nor leave its own in the cache."""
    import pipe.core.program_time as program_time

    monkeypatch.setattr(program_time, "_lowered", program_time._lowered.__wrapped__)


def mlp(layers: int = 4, width: int = 32, seed: int = 0) -> "nn.Sequential":
    """``layers`` blocks of ``Linear(width, 4 width), ReLU, Linear(4 width, width)``, seeded: the planner's
    and the runners' model of equal layers."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
                           for _ in range(layers)])


def assert_same_grads(model: "nn.Module", reference: "nn.Module", *, atol: Optional[float] = None,
                      rtol: Optional[float] = None, missing_is_zero: bool = False) -> None:
    """``model``'s gradients are ``reference``'s, parameter by parameter under the same names: within ``atol`` and
    ``rtol`` (torch's defaults for the dtype when not given; 0 and 0: equal). Every parameter has a gradient,
    unless ``missing_is_zero``: then a gradient identically zero may be None in one graph and zeros in the
    other."""
    import torch

    got, expected = dict(model.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == expected.keys(), (list(got), list(expected))
    for name, p in got.items():
        q = expected[name]
        if missing_is_zero:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            want = q.grad if q.grad is not None else torch.zeros_like(q)
        else:
            assert p.grad is not None and q.grad is not None, f"{name} has no gradient"
            grad, want = p.grad, q.grad
        torch.testing.assert_close(grad, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


class FakeClock:
    """A clock that moves only when told to (:meth:`advance`): it stands for ``time.perf_counter`` where the
    code times layers, so that a test of what is timed, and where the time lands, does not depend on how fast
    or how busy the machine is (tests never time things)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_layer_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """For the rest of the test, layers timed on the CPU (:class:`pipe.balance.clock.Clock`, under
    ``time_layers``, ``balance_by_time`` and ``profile_costs``) are timed by a :class:`FakeClock`, which only
    :func:`ticking` layers (or the test) move: a layer's measured time is what it was charged."""
    import types

    import pipe.balance.clock as clock

    fake = FakeClock()
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def ticking(module: "nn.Module", clock: FakeClock, forward: float, backward: float = 0.0) -> "nn.Module":
    """``module`` (changed in place, and returned) charged ``forward`` seconds of ``clock`` per forward call and
    ``backward`` per backward: a forward hook moves the clock, and passes the output's first tensor that needs
    a gradient through a function whose backward moves it. The hook is a plain closure: copies of the module
    (the profilers time copies) move the same clock."""
    import torch

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: "torch.Tensor") -> "torch.Tensor":
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: "torch.Tensor") -> "torch.Tensor":
            clock.advance(backward)
            return grad

    def hook(_module: "nn.Module", _args: Any, output: Any) -> Any:
        clock.advance(forward)
        if isinstance(output, torch.Tensor):
            return Tick.apply(output) if output.requires_grad else output
        if isinstance(output, tuple):
            k = next((k for k, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if k is not None:
                return (*output[:k], Tick.apply(output[k]), *output[k + 1:])
        return output

    module.register_forward_hook(hook)
    return module


def tabled_times(costs: "Costs", forward: float = 1e-5, backward: Optional[float] = None) -> "Costs":
    """``costs`` (changed in place, and returned) with its measured layer times replaced by a table, its counted
    bytes kept: every layer ``forward`` seconds per sample, its backward ``backward`` (default twice that), I and
    W half of it each, a recompute mark's replay its forward again, a selective mark's a tenth of it (where it
    could be measured), no checkpoint overhead. For a test of what a real model's bytes let a plan do: planned
    on its measured times, the choice would depend on how busy the machine was (tests never time things)."""
    import math

    backward = 2 * forward if backward is None else backward

    def table(seconds: float) -> dict[int, list[float]]:
        return {rows: [seconds * rows] * costs.layers for rows in costs.forward}

    costs.forward, costs.backward = table(forward), table(backward)
    costs.input_grad, costs.weight_grad = table(backward / 2), table(backward / 2)
    costs.replay = table(forward)
    if costs.select_replay is not None:  # a layer that fails so marked stays unmarkable
        costs.select_replay = {rows: [math.inf if math.isinf(t) else forward / 10 * rows for t in times]
                               for rows, times in costs.select_replay.items()}
    costs.checkpoint_overhead = 0.0
    return costs


def plan_tabled_times(monkeypatch: pytest.MonkeyPatch, forward: float = 1e-5) -> None:
    """For the rest of the test, ``pipe.plan.plan`` (and what calls it: ``planned_pipe``, ``pipe-plan``) plans the
    costs it profiles with :func:`tabled_times`: the model's bytes as counted, its times from the table."""
    import pipe.plan.planning as planning

    real = planning.profile_costs
    monkeypatch.setattr(planning, "profile_costs", lambda *args, **kwargs: tabled_times(real(*args, **kwargs), forward))
