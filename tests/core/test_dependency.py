"""Fork and join add ordering edges without data."""
import torch

from pipe.core.dependency import fork, join
from pipe.core.phony import get_phony


def test_phony_is_cached_and_empty():
    a = get_phony(torch.device("cpu"), requires_grad=True)
    b = get_phony(torch.device("cpu"), requires_grad=True)
    assert a is b and a.numel() == 0 and a.requires_grad
    assert not get_phony(torch.device("cpu"), requires_grad=False).requires_grad


def test_fork_join_orders_backward():
    order = []
    a = torch.ones(1, requires_grad=True)
    b = torch.ones(1, requires_grad=True)
    a.register_hook(lambda g: order.append("a"))
    b.register_hook(lambda g: order.append("b"))
    a2, phony = fork(a)
    b2 = join(b * 1, phony)
    # Without the edge, autograd could finish a first; with it, a waits for b's lane.
    (a2 * 2 + b2 * 3).sum().backward()
    assert order == ["b", "a"]
    assert a.grad.item() == 2 and b.grad.item() == 3


def test_fork_join_keep_values_and_skip_without_grad():
    x = torch.arange(3.0)
    y, phony = fork(x)
    assert y is x and not phony.requires_grad
    assert join(x, phony) is x
    with torch.no_grad():
        z = torch.ones(1, requires_grad=True)
        assert fork(z)[0] is z
