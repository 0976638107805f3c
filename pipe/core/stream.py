"""Devices and streams, with CPU stand-ins so that one code path serves both.

CUDA work is ordered by streams; the CPU has none. The pipeline is written
against :data:`AbstractStream` so that the same fence/copy/compute logic runs on
a CPU-only machine (every stream is the :data:`CPUStream` placeholder and every
stream operation is a no-op) and on CUDA devices (real streams, events and
``record_stream`` so that the caching allocator does not recycle memory that
another stream still reads).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Union, cast

import torch

__all__: list[str] = []


class CPUStreamType:
    """The placeholder stream of the CPU: operations on it are no-ops."""

    def __repr__(self) -> str:
        return "CPUStream"


#: The only instance of :class:`CPUStreamType`.
CPUStream = CPUStreamType()

AbstractStream = Union[torch.cuda.Stream, CPUStreamType]


def new_stream(device: torch.device) -> AbstractStream:
    """Creates a new stream on ``device`` (a CPU stand-in off CUDA)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    """The stream work on ``device`` is issued to right now."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    """The default stream of ``device``."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Makes ``device`` the current CUDA device (does nothing for the CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Makes ``stream`` current on its device (does nothing for the CPU)."""
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(as_cuda(stream)):
        yield


def get_device(stream: AbstractStream) -> torch.device:
    """The device ``stream`` belongs to."""
    if is_cuda(stream):
        return as_cuda(stream).device
    return torch.device("cpu")


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Makes ``source`` wait until the work queued on ``target`` so far is done.

    A CUDA stream waits on the device; the CPU (which has no stream to wait on
    the device) synchronises the target stream instead.
    """
    if not is_cuda(target):
        return
    if is_cuda(source):
        as_cuda(source).wait_stream(as_cuda(target))
    else:
        as_cuda(target).synchronize()


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tells the caching allocator that ``stream`` uses ``tensor``'s memory.

    The whole storage is recorded (through a size-0 alias), because views of
    a tensor share its storage and the allocator frees storages, not views.
    """
    if not is_cuda(stream) or tensor.device.type != "cuda":
        return
    alias = tensor.new_empty([0]).set_(tensor.untyped_storage())
    alias.record_stream(as_cuda(stream))


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is a real CUDA stream."""
    return stream is not CPUStream


def as_cuda(stream: AbstractStream) -> torch.cuda.Stream:
    """Narrows ``stream`` to a CUDA stream for the type checker."""
    return cast(torch.cuda.Stream, stream)
