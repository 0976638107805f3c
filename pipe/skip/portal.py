"""Portals: carry a skip tensor from its stash partition straight to its pop partition.

A skip tensor must not travel through the partitions between its stash and
its pop (that would copy it through every device on the way and tie it to
their schedules). Autograd, however, only sees tensors that flow along the
graph. A :class:`Portal` hides the tensor from autograd and keeps the graph
connected with three phony-only edges on the micro-batch's main lane::

    stash partition         fence of the pop partition          pop partition
    ── Join ──────────── Fork ── Join ────────────────── Fork ──── f(x, skip)
        │                  │      │                       │          ↑
      PortalBlue           └─PortalCopy─┘              PortalOrange ─┘
      (hides the tensor)   (moves it to the pop device)   (hands it out)

In backward, PortalOrange puts the skip's gradient into the portal,
PortalCopy moves it back to the stash device, and PortalBlue returns it as
the gradient of the stashed tensor. The main lane orders the three: the
stash partition's backward cannot start before the pop partition's is done.

The tensor is dropped from the portal as soon as its last reader has taken
it (its *life*, see :meth:`Portal.put_tensor`), so portals hold no memory
beyond what autograd itself keeps.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from pipe.core.copy import Copy
from pipe.core.phony import get_phony
from pipe.core.stream import AbstractStream, get_device

__all__: list[str] = []


class Portal:
    """Holds one skip tensor (or ``None``) of one micro-batch, and its gradient.

    Args:
        tensor: the stashed tensor.
        tensor_life: how many times it will be taken before it is dropped.
    """

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.tensor: Optional[Tensor] = None
        self.tensor_life = 0
        self.grad: Optional[Tensor] = None
        self.put_tensor(tensor, tensor_life)

    def blue(self) -> Tensor:
        """Hides the tensor; join the returned phony to the stash partition's main lane."""
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, tensor)

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """The tensor for the pop; ``phony`` is forked off the pop partition's main lane."""
        self._check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        return PortalOrange.apply(self, phony)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Moves the tensor to ``next_stream``'s device; join the returned phony to the main lane."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        """Stores ``tensor`` for ``tensor_life`` takes.

        The events that take it ([x]) in one forward and backward::

             1. [x] blue()                         stash partition, forward
             2. [ ] copy()                         fence of the pop partition
             3. [x] orange()                       pop partition, forward
             - - - - - - - - - - - - - - - - - - - only when checkpointed:
             4. [x] orange() (recomputed)          pop partition, backward
             5. [x] blue() (recomputed)            stash partition, backward

        Without checkpointing the life is 2; with it, 3 for the first forward
        and 1 again for the recomputed stash (which puts a new tensor).
        """
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[Tensor]:
        """Takes the tensor; the last take drops it from the portal."""
        self._check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Optional[Tensor]) -> None:
        self.grad = grad

    def use_grad(self) -> Optional[Tensor]:
        """Takes the gradient (``None`` when the popped tensor got none)."""
        grad, self.grad = self.grad, None
        return grad

    def _check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError(
                "a skip tensor was taken from its portal more often than stashed; a skippable layer "
                "was probably called outside the pipeline's order (e.g. twice per micro-batch)"
            )


class PortalBlue(torch.autograd.Function):
    """Hides a tensor from autograd; its gradient comes back through the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, Optional[Tensor]]:
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    """Hands out the hidden tensor; its gradient goes into the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None  # orange() checked it
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    """Replaces the hidden tensor by its copy on another device (and the gradient back)."""

    @staticmethod
    def forward(
        ctx: Any, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor
    ) -> Tensor:
        ctx.portal = portal
        assert portal.tensor is not None  # copy() checked it
        (portal.tensor,) = Copy.forward(ctx, prev_stream, next_stream, portal.tensor)
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, None, None, None]:
        portal = ctx.portal
        if portal.grad is not None:
            _, _, portal.grad = Copy.backward(ctx, portal.grad)
        return None, None, None, None
