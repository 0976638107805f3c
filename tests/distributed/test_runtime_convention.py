"""DistributedPipe honours PipeSequential's calling convention across ranks; PipeSequential is the oracle."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from pipe import PipeSequential
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from convention_models import encoder, inputs, loss_fn, skip_encoder, targets  # noqa: E402


def _oracle(model: PipeSequential, args: tuple, target: torch.Tensor) -> tuple:
    plain = copy.deepcopy(model)
    output = plain(*args)
    loss = loss_fn(output, target)
    loss.backward()
    return output.detach(), loss.detach(), {n: p.grad.clone() for n, p in plain.named_parameters()}


def _convention(rank: int, world: int) -> int:
    cases = [  # encoder(): Embed | Attention | Pack | Unpack | Attention | Pool
        ("encoder [1, 5]: a tuple crosses", encoder(), [1, 5]),
        ("encoder [3, 3]: a list crosses", encoder(), [3, 3]),
        ("skip_encoder [3, 3]: the residual crosses", skip_encoder(), [3, 3]),
    ]
    checked = 0
    for label, model, balance in cases:
        for schedule in ("gpipe", "1f1b"):
            for checkpoint in ("always", "except_last", "never"):
                where = f"{label} {schedule}/{checkpoint}"
                pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                       balance=balance, loss_fn=loss_fn)
                assert all(type(p) is PipeSequential for p in pipe.partitions.values()), where
                args, target = inputs(10, seed=checked), targets(10, seed=checked)
                expected_output, expected_loss, expected_grads = _oracle(model, args, target)
                loss = pipe.step(args, target)  # several inputs: a tuple, as PipeSequential(*args) takes them
                owned = dict(pipe.named_parameters())
                assert owned, where
                for name, parameter in owned.items():
                    assert parameter.grad is not None, f"{where}: {name}"
                    torch.testing.assert_close(parameter.grad, expected_grads[name],
                                               msg=lambda m: f"{where}: {name}\n{m}")
                output = pipe(*args)  # forwards only, several inputs as arguments
                if pipe.is_last:
                    torch.testing.assert_close(loss, expected_loss, msg=lambda m: f"{where}: loss\n{m}")
                    torch.testing.assert_close(output, expected_output, msg=lambda m: f"{where}: output\n{m}")
                else:
                    assert loss is None and output is None, where
                checked += 1
    return checked


def test_matches_pipe_sequential_on_two_ranks() -> None:
    assert run_ranks(_convention, 2, deadline=120.0) == [18, 18]
