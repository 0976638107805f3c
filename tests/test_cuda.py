"""The CUDA paths of ``Pipe`` on a real GPU, against the plain model.

Skipped without a GPU. Covered here: partitions on ``cuda:0`` and between
``cuda:0`` and the CPU (copy streams, ``record_stream`` on the copies), every
checkpoint mode, the CUDA random state replayed by recomputation, activation
memory read from ``torch.cuda.max_memory_allocated``, balancing on the GPU,
and compiled stages with inductor. Elsewhere: ``DistributedPipe`` over gloo
with CUDA tensors (tests/distributed/test_cuda_ranks.py), skips copied
between devices (tests/skip/test_tracker.py), offload to pinned memory
(tests/recompute/test_offload.py, tests/distributed/test_recompute.py),
autocast (tests/core/test_threadstate.py), streams (tests/core/test_stream.py).

Tolerance: the GPU's float32 matrix products sum in another order than the
CPU's, so outputs and gradients are compared with ``atol=1e-5, rtol=1e-4``;
TF32 stays off (torch's default for matrix products).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipe import Pipe
from pipe.balance import balance_by_size, balance_by_time

pytestmark = pytest.mark.cuda

CHECKPOINTS = ("always", "except_last", "never")
DEVICES = (["cuda:0", "cuda:0"], ["cuda:0", "cpu"], ["cpu", "cuda:0"])
TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def stack(dropout: float = 0.0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.LayerNorm(2 * width),
                         nn.Dropout(dropout), nn.Linear(2 * width, width), nn.Tanh())


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("devices", DEVICES, ids=lambda d: "-".join(d))
def test_partitions_on_the_gpu_and_the_cpu_match_the_plain_model(devices: list[str], checkpoint: str) -> None:
    plain = stack()
    piped = Pipe(copy.deepcopy(plain), chunks=4, checkpoint=checkpoint, balance=[3, 3], devices=devices)
    assert [str(next(p.parameters()).device) for p in piped.partitions] == devices
    for step, size in enumerate((10, 7, 10)):  # uneven micro-batches; later steps reuse freed copy buffers
        x = torch.randn(size, 16, generator=torch.Generator().manual_seed(step))
        x_piped = x.to(devices[0], copy=True).requires_grad_()
        x_plain = x.clone().requires_grad_()
        piped.zero_grad()
        plain.zero_grad()
        out = piped(x_piped)
        assert out.device == torch.device(devices[-1])
        out.square().sum().backward()
        expected = plain(x_plain)
        expected.square().sum().backward()
        torch.testing.assert_close(out.detach().cpu(), expected.detach(), **TOLERANCE)
        torch.testing.assert_close(x_piped.grad.cpu(), x_plain.grad, **TOLERANCE)
        for a, b in zip(_grads(piped), _grads(plain), strict=True):
            torch.testing.assert_close(a, b, **TOLERANCE)
    piped.close()


@pytest.mark.parametrize("devices", (["cuda:0", "cuda:0"], ["cpu", "cuda:0"]), ids=lambda d: "-".join(d))
def test_recomputation_replays_the_cuda_random_state(devices: list[str]) -> None:
    # Dropout sits in the second partition only, so its draws come in one order in every run.
    model = stack(dropout=0.5)
    results = {}
    for checkpoint in ("never", "always"):
        piped = Pipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, balance=[3, 3], devices=devices)
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)).to(devices[0])
        torch.manual_seed(7)
        out = piped(x)
        out.square().sum().backward()
        results[checkpoint] = (out.detach().cpu(), _grads(piped))
        piped.close()
    (out_never, grads_never), (out_always, grads_always) = results["never"], results["always"]
    dropped = stack()[:3](torch.randn(12, 16, generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(out_never, stack()[3:](dropped)), "dropout did not draw"
    assert torch.equal(out_always, out_never)
    for a, b in zip(grads_always, grads_never, strict=True):
        assert torch.equal(a, b)


def _activation_peak(checkpoint: str) -> int:
    torch.manual_seed(0)
    layers = [module for _ in range(32) for module in (nn.Linear(512, 512), nn.ReLU())]
    piped = Pipe(nn.Sequential(*layers), chunks=8, checkpoint=checkpoint, balance=[32, 32],
                 devices=["cuda:0", "cuda:0"])
    x = torch.randn(2048, 512, device="cuda:0")
    piped(x).sum().backward()  # warm-up: the allocator's pools and cuBLAS workspaces
    piped.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    piped(x).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    piped.close()
    return peak


def test_checkpointing_lowers_the_gpu_activation_peak() -> None:
    never, always = _activation_peak("never"), _activation_peak("always")
    # "never" keeps the 32 ReLUs' outputs (the next Linear's inputs): 2048 x 512 x 4 B x 32 = 128 MiB.
    assert never > 96 * 2**20, never
    assert always < 0.35 * never, (always, never)


def test_balancing_profiles_on_the_gpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 64))
    sample = torch.randn(256, 64)
    assert sum(balance_by_time(2, model, sample, timeout=0.2, device="cuda:0")) == 5
    by_size = balance_by_size(2, model, sample, chunks=2, device="cuda:0")
    assert sum(by_size) == 5 and by_size[0] >= 3, by_size  # the 4096-wide activations weigh most
    assert next(model.parameters()).device.type == "cpu"  # profiled on copies


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                    reason="compile= needs torch >= 2.13")
def test_compiled_stages_with_inductor_match_eager() -> None:
    plain = stack(width=32).to("cuda:0")
    for checkpoint in CHECKPOINTS:
        piped = Pipe(copy.deepcopy(plain), chunks=3, checkpoint=checkpoint, balance=[3, 3],
                     devices=["cuda:0", "cuda:0"], compile=True)
        for size in (9, 8):
            x = torch.randn(size, 5, 32, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(size))
            piped.zero_grad()
            plain.zero_grad()
            out = piped(x)
            out.square().mean().backward()
            expected = plain(x)
            expected.square().mean().backward()
            torch.testing.assert_close(out, expected, **TOLERANCE)
            for a, b in zip(_grads(piped), _grads(plain), strict=True):
                torch.testing.assert_close(a, b, **TOLERANCE)
        piped.close()
