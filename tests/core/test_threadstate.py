"""The caller's thread-local state reaches the workers and the recomputation (pipe.core.threadstate).

Oracle: the plain module under the same switches. Each cell of a pipeline
runs in an autocast region of its own, so its weights are cast for it (the
plain model's cache casts them once per region and sums the micro-batches'
weight gradients in low precision before casting them back): with several
micro-batches the oracle runs the plain module on each micro-batch, each in its
own autocast region, and concatenates.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipe import Pipe, is_recomputing
from pipe.core.threadstate import ThreadState

CHECKPOINTS = ("always", "except_last", "never")


class Probe(nn.Module):
    """Records the switches each forward sees: (recomputing, grad, inference, autocast on cpu, its dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, bool, bool, torch.dtype]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((is_recomputing(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                          torch.is_autocast_enabled("cpu"), x.dtype))
        return x


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), Probe(), nn.Linear(16, 16), nn.Dropout(0.0), Probe(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _oracle(plain: nn.Sequential, x: Tensor, chunks: int, device_type: str, dtype: torch.dtype) -> Tensor:
    outputs = []
    for part in x.tensor_split(chunks):
        with torch.autocast(device_type, dtype=dtype):
            outputs.append(plain(part))
    return torch.cat(outputs)


def _check_autocast(device: str, dtype: torch.dtype, checkpoint: str, chunks: int, worker_backward: bool) -> None:
    label = f"{device} {dtype} checkpoint={checkpoint} chunks={chunks} worker_backward={worker_backward}"
    base = model().to(device)
    piped_model, plain = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(device)
    piped = Pipe(piped_model, chunks=chunks, checkpoint=checkpoint, balance=[3, 3, 3], devices=[device] * 3)
    piped._pipeline.worker_backward = piped._pipeline.worker_backward and worker_backward
    with torch.autocast(device, dtype=dtype):
        output = piped(x)
    expected = _oracle(plain, x, chunks, device, dtype)
    assert output.dtype == expected.dtype == dtype, label
    torch.testing.assert_close(output, expected, msg=lambda m: f"{label}: output\n{m}")
    output.float().pow(2).sum().backward()  # backward outside autocast, as recommended
    expected.float().pow(2).sum().backward()
    for (name, p), q in zip(piped_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{label}: {name}\n{m}")
    # Every forward and every recomputation ran under the caller's autocast, with its dtype.
    for probe in (piped_model[2], piped_model[5]):
        recomputed = [seen for seen in probe.seen if seen[0]]
        checkpointed = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
        assert len(recomputed) == checkpointed, label
        if device == "cpu":
            assert all(seen[3] for seen in probe.seen), (label, probe.seen)
        assert all(seen[4] == dtype for seen in probe.seen), (label, probe.seen)
        assert all(seen[1] for seen in recomputed), label  # recomputation with grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_matches_plain_module(dtype: torch.dtype) -> None:
    for checkpoint in CHECKPOINTS:
        for chunks in (1, 4):
            _check_autocast("cpu", dtype, checkpoint, chunks, worker_backward=True)
        _check_autocast("cpu", dtype, checkpoint, 4, worker_backward=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_matches_plain_module(dtype: torch.dtype) -> None:
    for checkpoint in CHECKPOINTS:
        for chunks in (1, 4):
            _check_autocast("cuda", dtype, checkpoint, chunks, worker_backward=False)


def test_autocast_off_inside_the_pipe_when_off_outside() -> None:
    """A replay on a thread that has autocast on (backward inside autocast) still replays the forward's dtypes."""
    base = model()
    piped_model, plain = copy.deepcopy(base), copy.deepcopy(base)
    piped = Pipe(piped_model, chunks=2, checkpoint="always", balance=[3, 6], devices=["cpu", "cpu"])
    piped._pipeline.worker_backward = False  # recomputation on the caller's (autograd's) thread
    x = torch.randn(4, 8)
    output = piped(x)
    expected = torch.cat([plain(part) for part in x.tensor_split(2)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output.sum().backward()
        expected.sum().backward()
    assert all(seen[4] == torch.float32 and not seen[3] for seen in piped_model[5].seen)
    for p, q in zip(piped_model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_inference_mode_and_no_grad_reach_the_workers(mode: str) -> None:
    base = model()
    piped_model, plain = copy.deepcopy(base), copy.deepcopy(base)
    piped = Pipe(piped_model, chunks=4, balance=[3, 3, 3], devices=["cpu"] * 3)
    x = torch.randn(8, 8)
    context: Any = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        output = piped(x)
        expected = plain(x)
    torch.testing.assert_close(output, expected)
    assert output.requires_grad is expected.requires_grad is False
    assert output.is_inference() == expected.is_inference() == (mode == "inference_mode")
    inference = mode == "inference_mode"
    assert piped_model[5].seen and all(seen[1:3] == (False, inference) for seen in piped_model[5].seen)


def test_saved_tensors_hooks_reach_the_workers() -> None:
    """The caller's default saved-tensor hooks (e.g. torch.autograd.graph.save_on_cpu) pack the workers' tensors."""
    base = model()
    piped_model, plain = copy.deepcopy(base), copy.deepcopy(base)
    piped = Pipe(piped_model, chunks=1, checkpoint="never", balance=[3, 3, 3], devices=["cpu"] * 3)
    x = torch.randn(8, 8)
    counts = {"pipe": 0, "plain": 0}

    def hooks(key: str) -> Any:
        def pack(tensor: Tensor) -> Tensor:
            counts[key] += 1
            return tensor
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    with hooks("pipe"):
        output = piped(x)
    with hooks("plain"):
        expected = plain(x)
    assert counts["pipe"] == counts["plain"] > 0
    output.sum().backward()
    expected.sum().backward()
    for p, q in zip(piped_model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_capture_and_restore_on_another_thread() -> None:
    import threading

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        state = ThreadState.capture()
    seen: list[Any] = []

    def run() -> None:
        with state.restore():
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled()))
        seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(True, torch.bfloat16, False), (False, True)]
