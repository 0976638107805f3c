"""Copy and Wait: move micro-batches between devices on copy streams.

A partition computes on its device's compute stream. Moving its output to the
next device on that same stream would stall compute behind the transfer, so
every micro-batch gets its own copy stream and the hand-over is::

    prev compute ──wait──> copy stream: x.to(next device) ──wait──> next compute
                    (Wait)          (Copy)                 (Wait)

Both are autograd functions, so the gradient travels back the same way on the
same streams. ``record_stream`` keeps the caching allocator from reusing a
tensor's memory while another stream may still read it. On the CPU every
stream is a stand-in and these reduce to ``Tensor.to``.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

from pipe.core.microbatch import Batch
from pipe.core.stream import AbstractStream, current_stream, get_device, record_stream, use_stream, wait_stream

__all__: list[str] = []


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Moves ``batch`` to ``next_stream``'s device on the copy streams (Copy, then Wait)."""
    batch.replace_tensors(Copy.apply(prev_stream, next_stream, *batch.tensors))
    wait(batch, prev_stream, next_stream)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Makes ``next_stream`` wait for the work on ``prev_stream`` that produced ``batch``."""
    batch.replace_tensors(Wait.apply(prev_stream, next_stream, *batch.tensors))


class Copy(torch.autograd.Function):
    """Copies tensors from ``prev_stream``'s device to ``next_stream``'s."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        output = []
        output_stream = current_stream(get_device(next_stream))
        with use_stream(prev_stream), use_stream(next_stream):
            for x in input:
                y = x.to(get_device(next_stream), non_blocking=True)
                output.append(y)
                # The input is read on prev_stream; the output is used by
                # whatever stream is current on the next device.
                record_stream(x, prev_stream)
                record_stream(y, output_stream)
        # A tensor that needs no gradient (a table made from buffers) gets none on the next device either.
        ctx.mark_non_differentiable(*[y for x, y in zip(input, output) if not x.requires_grad])
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Any, ...]:
        prev_stream = ctx.prev_stream
        next_stream = ctx.next_stream
        grad_input: deque[Tensor] = deque(maxlen=len(grad_output))
        input_stream = current_stream(get_device(prev_stream))
        with use_stream(prev_stream), use_stream(next_stream):
            for x in reversed(grad_output):
                y = x.to(get_device(prev_stream), non_blocking=True)
                grad_input.appendleft(y)
                record_stream(x, next_stream)
                record_stream(y, input_stream)
        return (None, None) + tuple(grad_input)


class Wait(torch.autograd.Function):
    """Makes ``next_stream`` wait for ``prev_stream`` (and the reverse in backward)."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        wait_stream(next_stream, prev_stream)
        output = tuple(x.detach() for x in input)
        ctx.mark_non_differentiable(*[y for x, y in zip(input, output) if not x.requires_grad])
        return output

    @staticmethod
    def backward(ctx: Any, *grad_input: Tensor) -> tuple[Any, ...]:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None) + grad_input
