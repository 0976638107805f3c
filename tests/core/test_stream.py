"""Streams: CPU stand-ins, and real CUDA streams where there is a GPU."""
import pytest
import torch

from pipe.core.copy import Copy, Wait
from pipe.core.stream import (CPUStream, current_stream, default_stream, get_device, is_cuda, new_stream,
                         record_stream, use_device, use_stream, wait_stream)

CPU = torch.device("cpu")


def test_cpu_streams_are_stand_ins():
    for stream in (new_stream(CPU), current_stream(CPU), default_stream(CPU)):
        assert stream is CPUStream and not is_cuda(stream)
        assert get_device(stream) == CPU
    with use_device(CPU), use_stream(CPUStream):
        wait_stream(CPUStream, CPUStream)
        record_stream(torch.zeros(1), CPUStream)


def test_copy_and_wait_on_cpu_keep_values_and_gradients():
    x = torch.randn(3, requires_grad=True)
    (y,) = Copy.apply(CPUStream, CPUStream, x)
    (z,) = Wait.apply(CPUStream, CPUStream, y)
    (z * 2).sum().backward()
    assert torch.equal(z, x)
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_copy_and_wait_keep_a_tensor_that_needs_no_gradient_without_one():
    x = torch.randn(3, requires_grad=True)
    table = torch.arange(3.0)  # made from buffers: no gradient
    y, t = Copy.apply(CPUStream, CPUStream, x, table)
    z, u = Wait.apply(CPUStream, CPUStream, y, t)
    assert z.requires_grad and not t.requires_grad and not u.requires_grad
    (z * u).sum().backward()
    assert torch.equal(x.grad, table)


@pytest.mark.cuda
def test_cuda_copy_between_streams():
    device = torch.device("cuda", 0)
    prev, nxt = new_stream(device), new_stream(device)
    assert is_cuda(prev) and get_device(prev) == device
    x = torch.randn(1000, device=device, requires_grad=True)
    (y,) = Copy.apply(prev, nxt, x)
    (z,) = Wait.apply(prev, nxt, y)
    (z * 2).sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(z, x)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@pytest.mark.cuda
def test_cuda_to_cpu_copy():
    x = torch.randn(10, requires_grad=True)
    (y,) = Copy.apply(CPUStream, new_stream(torch.device("cuda", 0)), x)
    assert y.device.type == "cuda"
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(10))
