"""Portals: tensor life, None, and gradients handed back to the stash side."""
from __future__ import annotations

import pytest
import torch

from pipe.core.phony import get_phony
from pipe.skip.portal import Portal
from pipe.core.stream import CPUStream


def test_life_two_then_dropped() -> None:
    portal = Portal(torch.ones(1), 2)
    portal.blue()
    assert portal.tensor is not None
    portal.orange(get_phony(torch.device("cpu"), requires_grad=False))
    assert portal.tensor is None
    with pytest.raises(RuntimeError, match="taken from its portal more often than stashed"):
        portal.orange(get_phony(torch.device("cpu"), requires_grad=False))


def test_none_travels() -> None:
    portal = Portal(None, 2)
    portal.blue()
    phony = get_phony(torch.device("cpu"), requires_grad=False)
    assert portal.copy(CPUStream, CPUStream, phony).numel() == 0
    assert portal.orange(phony) is None


def test_gradient_goes_from_orange_to_blue() -> None:
    a = torch.ones(3, requires_grad=True)
    stashed = a * 2
    portal = Portal(stashed, 2)
    blue_phony = portal.blue()
    popped = portal.orange(get_phony(torch.device("cpu"), requires_grad=True))
    assert popped is not None and popped.requires_grad
    (popped * 5).sum().backward()  # the pop side: puts the gradient in the portal
    assert portal.grad is not None
    blue_phony.sum().backward()  # the stash side: takes it
    torch.testing.assert_close(a.grad, torch.full((3,), 10.0))
    assert portal.grad is None
