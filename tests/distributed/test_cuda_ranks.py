"""``DistributedPipe`` over gloo with CUDA tensors, on a real GPU, against the plain model (skipped without one).

Two ranks share the machine's one GPU, which NCCL refuses (one rank per
device), so the transport is gloo: it sends CUDA tensors through host memory.
Tolerance as in tests/test_cuda.py: ``atol=1e-5, rtol=1e-4``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks

pytestmark = pytest.mark.cuda

TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def stack(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.LayerNorm(2 * width),
                         nn.Linear(2 * width, width), nn.Tanh(), nn.Linear(width, width))


def _gloo_over_cuda(rank: int, world: int) -> list[str]:
    device = torch.device("cuda", 0)
    done = []
    for schedule, checkpoint in (("1f1b", "except_last"), ("gpipe", "never"), ("zbv", "always")):
        model = stack(32)
        plain = copy.deepcopy(model).to(device)
        balance = [2, 1, 1, 2] if schedule == "zbv" else [3, 3]
        piped = DistributedPipe(copy.deepcopy(model), chunks=4, balance=balance, checkpoint=checkpoint,
                                schedule=schedule, loss_fn=F.mse_loss, device=device)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(device)
        y = torch.randn(8, 32, generator=torch.Generator().manual_seed(4)).to(device)
        loss = piped.step(x, y)
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        if loss is not None:  # the rank of the last stage
            torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
        grads = dict(plain.named_parameters())
        for name, p in piped.named_parameters():
            assert p.device == device, name
            torch.testing.assert_close(p.grad, grads[name].grad, msg=name, **TOLERANCE)
        done.append(f"{schedule}{'+loss' if loss is not None else ''}")
    return done


def test_distributed_pipe_over_gloo_with_cuda_tensors() -> None:
    assert run_ranks(_gloo_over_cuda, 2, timeout=60.0, deadline=240.0) == [
        ["1f1b", "gpipe", "zbv+loss"], ["1f1b+loss", "gpipe+loss", "zbv"]]


def _planned_on_cuda(rank: int, world: int) -> tuple[list[str], bool]:
    import pipe.plan.apply as apply

    device = torch.device("cuda", 0)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(device)
    y = torch.randn(8, 32, generator=torch.Generator().manual_seed(4)).to(device)
    profiled_on: list[str] = []
    search = apply.plan
    apply.plan = lambda *args, **kwargs: profiled_on.append(str(kwargs.get("device"))) or search(*args, **kwargs)
    try:
        piped = apply.planned_distributed(stack(32), x, memory_budget="1GiB", target=y, loss_fn=F.mse_loss,
                                          device=device)
    finally:
        apply.plan = search
    plain = stack(32).to(device)
    loss = piped.step(x, y)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    if loss is not None:
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
    grads = dict(plain.named_parameters())
    for name, p in piped.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name, **TOLERANCE)
    return profiled_on, loss is not None


def test_memory_budget_plans_on_the_ranks_gpu() -> None:
    """Rank 0 profiles the layers on the device the ranks train on, and the planned pipe matches the plain model."""
    results = run_ranks(_planned_on_cuda, 2, timeout=60.0, deadline=240.0)
    assert [r[0] for r in results] == [["cuda:0"], []], results
    assert sorted(r[1] for r in results) == [False, True], results  # one rank holds the last stage
