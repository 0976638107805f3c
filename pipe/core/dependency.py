"""Fork and join: ordering edges between autograd lanes.

Backward runs in whatever order the autograd graph allows. The pipeline needs
micro-batch i to finish its backward on a partition before micro-batch i-1
moves on to the previous partition, and it needs recomputation to start as soon
as a gradient reaches a checkpoint. ``fork`` splits a phony tensor off a lane
and ``join`` attaches it to another, adding an edge that carries no data::

    lane a:  x --Fork--> x' ------------------>  (gradient of x waits for phony)
                   \\
                    phony
                      \\
    lane b:  y ------Join--> y'                  (y' backward releases phony)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipe.core.microbatch import Batch
from pipe.core.phony import get_phony

__all__: list[str] = []


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Makes ``fork_from``'s backward wait for ``join_to``'s: a phony forked off one lane, joined to the other."""
    fork_from.tensor, phony = fork(fork_from.tensor)
    join_to.tensor = join(join_to.tensor, phony)


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """Branches a phony off ``input``.

    Returns:
        ``(input', phony)``: ``input'`` carries ``input``'s data; the gradient of
        ``input`` is released only when both ``input'`` and ``phony`` have
        received theirs.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        input, phony = Fork.apply(input)
    else:
        phony = get_phony(input.device, requires_grad=False)
    return input, phony


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_phony: Tensor) -> Tensor:
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Attaches ``phony`` to ``input``: ``input``'s backward releases ``phony``."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)
    return input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> tuple[Tensor, None]:
        # The phony gets no gradient (None), but the engine still runs the
        # node it comes from once this one is done: that is the edge.
        return grad_input, None
