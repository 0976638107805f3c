"""What FSDP holds while it gathers a stage a layer at a time, counted as the stage runs.

``DistributedPipe(..., shard=Shard(unit="block"))`` has FSDP2's own hooks
gather each layer of a stage around its forward and its backward
(:mod:`pipe.distributed.fsdp`). The planner counts a stage's bytes by running
its layers on one micro-batch under :class:`pipe.recompute.ActivationMemory`
(:mod:`pipe.plan.profile`); :class:`BlockGathers` adds to that count, around
the same layers' forwards and backwards, the bytes FSDP holds there, so that
the peaks are those of the layers gathered beside the activations of that
moment. The parameters themselves stand for their shards (they exist before
counting); what is added is the unsharded copies and FSDP's buffers:

* a layer's gather arrives in a buffer as large as the layer and is copied
  out into its parameters. In a backward the buffer is freed at once. In a
  forward it is freed there too on the CPU (the runner frees it,
  :class:`pipe.distributed.fsdp._BeforeForward`), while on a GPU FSDP keeps it
  until the next layer's copy out, so that the copy can overlap that gather;
  a layer of one parameter gathers on the CPU into the parameter itself, with
  no buffer to copy from;
* in a forward (a checkpointed cell's replay too) each layer then starts the
  next one's gather, whose buffer is held during the layer's forward; after
  its forward a layer's parameters are freed;
* in a backward, a layer is gathered when the gradient of its output arrives
  and starts the gather of the layer before it; once its inputs' gradients are
  computed (a stage's first layer, whose input needs none: once its parameters
  have theirs) it is freed;
* reducing after each backward (``reduce="micro-batch"``), a layer's
  gradients are then copied into a buffer for the reduce-scatter and freed;
  FSDP keeps that buffer until the next layer's reduce-scatter, the stage's
  first layer's until the stage's next backward (:meth:`BlockGathers.keep_reduced`)
  or its reduce at the step's end (that span is
  :func:`pipe.plan.sharding.held_by_fsdp`'s). With replicas too (HSDP) FSDP
  also keeps each layer's all-reduced gradient shard until that layer's next
  reduce frees it (its first becomes the shard's ``.grad`` itself): what that
  adds depends on the replica count and on which backward of the step this
  is, so the count records, instead, the backward's peak between reduces and
  at each (:attr:`BlockGathers.reduces`), for
  :func:`pipe.plan.sharding.backward_peak_with_shards` to add those shards to.

What a stage holds outside its layers (a tied embedding read under the
head's name in a piece of :func:`pipe.split`) the runner gathers whole for
each action: it is counted held throughout. A layer the runner keeps gathered from one action to the next (a stage's last
from a forward to its backward, :meth:`pipe.distributed.fsdp.StageSharding.entering`)
is counted gathered again, on the safe side.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipe.recompute.memory import ActivationMemory

__all__: list[str] = []


class BlockGathers:
    """Adds to ``counter`` the bytes FSDP holds while ``stage``'s layers (its blocks under ``Shard(unit="block")``,
    :func:`pipe.distributed.fsdp.gathered_blocks`) run forward and backward inside the ``with`` body.

    Args:
        stage: the stage whose layers are counted (hooks are added to them in the body, removed after).
        counter: the count to add to.
        reduce_each: ``Shard(reduce="micro-batch")``: a layer's gradients are reduce-scattered and freed after
            each of its backwards (the counted backward creates them).
        device: where the stage runs (on the CPU a forward frees each gather's buffer at once).
    """

    def __init__(self, stage: nn.Module, counter: ActivationMemory, reduce_each: bool, device: torch.device) -> None:
        from pipe.distributed.fsdp import gathered_blocks

        self.counter, self.reduce_each = counter, reduce_each
        self.blocks = gathered_blocks(stage)
        self.params = [list(block.parameters()) for block in self.blocks]
        self.bytes = [sum(p.numel() * p.element_size() for p in params) for params in self.params]
        self.in_place = [device.type == "cpu" and len(params) == 1 for params in self.params]
        self.keeps_buffer = device.type != "cpu"  # FSDP keeps a forward's buffer to the next copy out
        in_blocks = {id(p) for params in self.params for p in params}
        #: Bytes of the stage's parameters outside its layers (a tied embedding read by the head's piece), which
        #: the runner gathers whole for each of the stage's actions: held throughout the count.
        self.rest = sum(p.numel() * p.element_size() for p in stage.parameters() if id(p) not in in_blocks)
        self.state = [""] * len(self.blocks)  # "", "buffer" (a gather in flight) or "gathered"
        self.waiting = [0] * len(self.blocks)  # parameters still to get their gradient in this backward
        self.by_inputs = [False] * len(self.blocks)  # its backward ends with its inputs' gradients
        self.buffer: Optional[int] = None  # the layer whose forward gather's buffer is kept
        self.reducing: Optional[int] = None  # the layer whose reduce-scatter input is kept
        #: With ``reduce_each``, the backward's bytes in order: ``(0, peak)`` since the previous reduce (or the
        #: start), ``(layer's bytes, bytes)`` when a layer's reduce-scatter input is allocated.
        self.reduces: list[tuple[int, int]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "BlockGathers":
        self.counter.adjust(self.rest)
        for k, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(
                lambda module, args, k=k: self._before_forward(k, args)))
            self.handles.append(block.register_forward_hook(
                lambda module, args, output, k=k: self._after_forward(k, output)))
            for param in self.params[k]:
                self.handles.append(param.register_post_accumulate_grad_hook(lambda param, k=k: self._accumulated(k)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def keep_reduced(self) -> None:
        """Before a backward that is not the stage's first of the step (``reduce_each``): the previous backward's
        last reduce-scatter input, its first layer's, is still held."""
        if self.blocks:
            self.reducing = 0
            self.counter.adjust(self.bytes[0])

    def _gather(self, k: int, forward: bool) -> None:
        if self.state[k] == "gathered":
            return
        if self.state[k] != "buffer":
            self.counter.adjust(self.bytes[k])  # the gather's buffer (or, in place, the parameters)
        if not self.in_place[k]:
            kept = forward and self.keeps_buffer
            if kept and self.buffer is not None:  # the previous layer's, freed before this copy out
                self.counter.adjust(-self.bytes[self.buffer])
                self.buffer = None
            self.counter.adjust(self.bytes[k])  # copied out into the parameters
            if kept:
                self.buffer = k
            else:
                self.counter.adjust(-self.bytes[k])  # the buffer freed
        self.state[k] = "gathered"
        self.waiting[k] = len(self.params[k])

    def _prefetch(self, k: int) -> None:
        if 0 <= k < len(self.blocks) and not self.state[k]:
            self.counter.adjust(self.bytes[k])
            self.state[k] = "buffer"

    def _reshard(self, k: int) -> None:
        if self.state[k] == "gathered":
            self.counter.adjust(-self.bytes[k])
            self.state[k] = ""

    def _before_forward(self, k: int, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        self._gather(k, forward=True)
        self._prefetch(k + 1)
        flat, spec = tree_flatten(args)
        inputs = [t for t in flat if isinstance(t, Tensor) and t.requires_grad]
        self.by_inputs[k] = torch.is_grad_enabled() and bool(inputs)
        if not self.by_inputs[k]:
            return None
        # As FSDP: the layer's backward ends when its inputs' gradients are computed.
        outputs = iter(_AfterBackward.apply(self, k, *inputs))
        return tree_unflatten([next(outputs) if isinstance(t, Tensor) and t.requires_grad else t for t in flat], spec)

    def _after_forward(self, k: int, output: Any) -> None:
        self._reshard(k)
        if k == len(self.blocks) - 1 and self.buffer is not None:  # the stage's forward frees the last buffer
            self.counter.adjust(-self.bytes[self.buffer])
            self.buffer = None
        if not torch.is_grad_enabled():
            return
        fired: list[bool] = []

        def before_backward(grad: Tensor) -> None:  # gathered again when its output's gradient arrives
            if not fired:
                fired.append(True)
                self._gather(k, forward=False)
                self._prefetch(k - 1)

        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, Tensor) and tensor.requires_grad:
                tensor.register_hook(before_backward)

    def _accumulated(self, k: int) -> None:
        self.waiting[k] -= 1
        if not self.waiting[k] and not self.by_inputs[k]:
            self.after_backward(k)

    def after_backward(self, k: int) -> None:
        """Layer ``k``'s backward is done: FSDP frees its parameters, and with ``reduce_each`` copies its
        gradients for their reduce-scatter (the previous copy freed first) and frees them."""
        self._reshard(k)
        if self.reduce_each:
            self.reduces.append((0, self.counter.peak_bytes))
            if self.reducing is not None:
                self.counter.adjust(-self.bytes[self.reducing])
            self.counter.adjust(self.bytes[k])
            self.reduces.append((self.bytes[k], self.counter.live_bytes))
            for param in self.params[k]:
                param.grad = None
            self.counter.reset_peak()
            self.reducing = k


class _AfterBackward(torch.autograd.Function):
    """The identity on a layer's inputs, whose backward tells :class:`BlockGathers` that the layer's is done."""

    @staticmethod
    def forward(ctx: Any, gathers: BlockGathers, k: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.gathers, ctx.k = gathers, k
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.gathers.after_backward(ctx.k)
        return (None, None, *grads)
