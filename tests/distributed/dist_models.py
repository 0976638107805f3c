"""Tiny models for the multi-process tests, and the plain-module oracle they are checked against."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipe.distributed import DistributedPipe

# The skip layers are the skip tests' own (one definition of the pair).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "skip"))
from models import PopLinear, StashLinear  # noqa: E402

WIDTH = 6


class Block(nn.Module):
    """Takes and returns ``(x, info)``: a float tensor and a dict with a long tensor and a Python float."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, value: tuple[Tensor, dict[str, Any]]) -> tuple[Tensor, dict[str, Any]]:
        x, info = value
        x = torch.tanh(self.linear(x)) * info["scale"] + info["ids"].unsqueeze(1).to(x.dtype) * 0.01
        return x, {"scale": info["scale"], "ids": info["ids"]}


class Head(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 3)

    def forward(self, value: tuple[Tensor, dict[str, Any]]) -> Tensor:
        return self.linear(value[0])


def block_factory(layers: int) -> Callable[[int], nn.Module]:
    """Layer i, the same on every rank: seeded by its index."""

    def factory(index: int) -> nn.Module:
        torch.manual_seed(1000 + index)
        return Head() if index == layers - 1 else Block()

    return factory


def blocks(layers: int = 8) -> nn.Sequential:
    factory = block_factory(layers)
    return nn.Sequential(*[factory(i) for i in range(layers)])


def batch(size: int, seed: int = 0) -> tuple[tuple[Tensor, dict[str, Any]], Tensor]:
    """Inputs ``(x, {"scale", "ids"})`` and targets for ``blocks``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=generator)
    ids = torch.randint(0, 5, (size,), generator=generator)
    target = torch.randn(size, 3, generator=generator)
    return (x, {"scale": 0.5, "ids": ids}), target


def skip_model(stash_at: int, pop_at: int, layers: int) -> nn.Sequential:
    """Linear layers with a skip from layer ``stash_at`` to layer ``pop_at``."""
    torch.manual_seed(7)
    entries: list[nn.Module] = []
    for i in range(layers):
        if i == stash_at:
            entries.append(StashLinear(WIDTH))
        elif i == pop_at:
            entries.append(PopLinear(WIDTH))
        else:
            entries.append(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
    return nn.Sequential(*entries)


def oracle(model: nn.Sequential, inputs: Any, target: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Output, loss and every gradient of the plain module on the whole batch."""
    plain = copy.deepcopy(model)
    output = plain(inputs)
    loss = F.mse_loss(output, target)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in plain.named_parameters() if p.grad is not None}
    return output.detach(), loss.detach(), grads


def check_against_oracle(pipe: DistributedPipe, model: nn.Sequential, inputs: Any, target: Tensor,
                         loss: Optional[Tensor], label: str) -> None:
    """Loss (on the last stage) and the gradient of every owned parameter equal the plain module's."""
    _, expected_loss, expected_grads = oracle(model, inputs, target)
    if pipe.is_last:
        assert loss is not None, label
        torch.testing.assert_close(loss, expected_loss, msg=lambda m: f"{label}: loss\n{m}")
    names = [name for name, _ in pipe.named_parameters()]
    assert names, label
    for name, parameter in pipe.named_parameters():
        assert parameter.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(parameter.grad, expected_grads[name], msg=lambda m: f"{label}: {name}\n{m}")


def check_table_steps(rank: int, table: Any, checkpoint: str, label: str, balance: Optional[list[int]] = None) -> None:
    """``blocks(8)`` run by ``table`` (a ``TableSchedule``) on this rank, two batches (10 and 8 rows): the stages
    are the table's, and the loss and every gradient equal the plain module's."""
    model = blocks(8)
    piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=table, balance=balance,
                            loss_fn=F.mse_loss)
    assert piped.stages == table.stages_of(rank), label
    for size, seed in ((10, 0), (8, 1)):
        inputs, target = batch(size, seed)
        piped.zero_grad()
        check_against_oracle(piped, model, inputs, target, piped.step(inputs, target), f"{label}/B={size}")


def train_tokens_against(piped: DistributedPipe, reference: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
                         steps: int, optimizer: Callable[[Any], torch.optim.Optimizer], vocab: int, label: str = "",
                         between: Optional[Callable[[], None]] = None) -> None:
    """``steps`` steps of token batches (8 x 5, seeded by the step) on ``piped`` and on the plain ``reference``:
    the loss and every gradient equal the plain model's; ``between`` runs after the check, before the updates."""
    optimizers = [optimizer(piped.parameters()), optimizer(reference.parameters())]
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randint(0, vocab, (8, 5), generator=generator)
        y = torch.randint(0, vocab, (8, 5), generator=generator)
        for each in optimizers:
            each.zero_grad()
        loss = piped.step(x, y)
        expected = loss_fn(reference(x), y)
        expected.backward()
        if piped.is_last:
            torch.testing.assert_close(loss, expected)
        for name, parameter in piped.named_parameters():
            torch.testing.assert_close(parameter.grad, reference.get_parameter(name).grad,
                                       msg=lambda m: f"{label} {name}: {m}")
        if between is not None:
            between()
        for each in optimizers:
            each.step()
