"""Helpers shared by the tests."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import pytest

if TYPE_CHECKING:
    from torch import nn


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
