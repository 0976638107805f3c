"""The caller's autocast and inference mode in DistributedPipe, on 2 gloo ranks, against the plain module.

Cells run on the rank's main thread, under the caller's switches; what must
be carried is the first forward's autocast to the recomputation in backward,
and the backward must run outside autocast as the plain model's does
(pipe.core.threadstate). The oracle runs each micro-batch in an autocast region
of its own, as a cell does (see tests/core/test_threadstate.py).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from dist_models import WIDTH
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks


class Float32Linear(nn.Linear):
    """A layer kept in float32 under autocast; its backward must not run under autocast either."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


def _model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.GELU(), Float32Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                         Float32Linear(16, 16), nn.GELU(), nn.Linear(16, WIDTH))


def _autocast(rank: int, world: int) -> int:
    model = _model()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, WIDTH, generator=generator)
    target = torch.randn(10, WIDTH, generator=generator)
    checked = 0
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("always", "except_last", "never"):
            label = f"{schedule}/{checkpoint}"
            pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                   loss_fn=F.mse_loss)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.step(x, target)
            plain = copy.deepcopy(model)
            expected = torch.zeros(())
            for part, part_target in zip(x.tensor_split(4), target.tensor_split(4)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    output = plain(part)
                    assert output.dtype == torch.bfloat16
                    part_loss = F.mse_loss(output, part_target)
                expected = expected + part_loss * (part.size(0) / x.size(0))
            expected.backward()
            if pipe.is_last:
                assert loss is not None
                torch.testing.assert_close(loss, expected.detach(), msg=lambda m: f"{label}: loss\n{m}")
            grads = dict(plain.named_parameters())
            for name, parameter in pipe.named_parameters():
                torch.testing.assert_close(parameter.grad, grads[name].grad, msg=lambda m: f"{label}: {name}\n{m}")
            # Forwards only, under inference mode and autocast: the plain module's output, dtype and kind.
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                output = pipe(x)
                plain_output = plain(x)
            if pipe.is_last:
                assert output.dtype == torch.bfloat16 and output.is_inference()
                torch.testing.assert_close(output, plain_output)
            checked += 1
    return checked


def test_autocast_and_inference_mode_match_plain_module() -> None:
    assert run_ranks(_autocast, 2) == [6, 6]
