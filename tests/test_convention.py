"""Pipe honours the calling convention of its container: ``PipeSequential`` is the oracle.

Several inputs reach the first layer as arguments, a tuple returned by a layer
is the next layer's arguments (also across a partition boundary), a list stays
one value, a Python float reaches every micro-batch; a plain ``nn.Sequential``
still passes one value.
"""
import copy
import gc
from typing import Iterator

import pytest
import torch
from torch import nn

from convention_models import AddResidual, StashResidual, encoder, inputs, loss_fn, skip_encoder, targets
from pipe import Pipe, PipeSequential
from pipe.recompute import recompute, select_recompute
from pipe.core.sequential import sequential_like

CHECKPOINTS = ["always", "except_last", "never"]
# encoder(): Embed | Attention | Pack | Unpack | Attention | Pool.
# [1, 5]: a (x, mask) tuple crosses; [3, 3]: the [x, mask] list crosses; [2, 2, 2]: two tuples cross.
BALANCES = [[6], [1, 5], [3, 3], [2, 2, 2]]


@pytest.fixture(autouse=True, scope="module")
def _collect_pipes() -> Iterator[None]:
    yield
    gc.collect()  # these tests' Pipes end their worker threads now, not in the middle of a later module


def _oracle(model: nn.Module, args: tuple, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    plain = copy.deepcopy(model)
    output = plain(*args)
    loss = loss_fn(output, target)
    loss.backward()
    return output.detach(), loss.detach(), {n: p.grad.clone() for n, p in plain.named_parameters()}


def _check(piped: Pipe, model: nn.Module, args: tuple, target: torch.Tensor) -> None:
    expected_output, expected_loss, expected_grads = _oracle(model, args, target)
    output = piped(*args)
    loss = loss_fn(output, target)
    loss.backward()
    torch.testing.assert_close(output, expected_output)
    torch.testing.assert_close(loss, expected_loss)
    grads = {n: p.grad for n, p in piped.named_parameters()}
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.filterwarnings("ignore:.*compete for them")  # 3 CPU partitions on a 2-core machine
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("balance", BALANCES, ids=str)
def test_matches_pipe_sequential(balance: list[int], chunks: int, checkpoint: str) -> None:
    model = encoder()
    piped = Pipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, balance=balance,
                 devices=["cpu"] * len(balance))
    assert all(type(p) is PipeSequential for p in piped.partitions)
    _check(piped, model, inputs(10), targets(10))  # 10 = 3+3+2+2 with chunks=4
    piped.close()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_skips_between_partitions_with_several_arguments(checkpoint: str) -> None:
    model = skip_encoder()
    piped = Pipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, balance=[2, 2, 2], devices=["cpu"] * 3)
    assert piped.skip_layout.routes  # the residual crosses from partition 0 to partition 2
    _check(piped, model, inputs(8, seed=1), targets(8, seed=1))
    piped.close()


def test_inputs_reach_the_first_layer_as_arguments() -> None:
    seen = []

    class First(nn.Module):
        def forward(self, x: torch.Tensor, ids: list, flag: str) -> tuple:
            seen.append((x.shape[0], ids, flag))
            return x * 2, flag

    class Second(nn.Module):
        def forward(self, x: torch.Tensor, flag: str) -> torch.Tensor:
            return x + (1 if flag == "on" else 0)

    ids = ["a", "b"]  # a list without tensors: one value, the same in every micro-batch
    model = PipeSequential(First(), Second())
    x = torch.randn(6, 2)
    expected = model(x, ids, "on")
    seen.clear()
    piped = Pipe(model, chunks=3, balance=[1, 1], devices=["cpu", "cpu"])
    torch.testing.assert_close(piped(x, ids, "on"), expected)
    assert seen == [(2, ids, "on")] * 3


def test_a_single_tuple_input_is_the_arguments_as_in_pipe_sequential() -> None:
    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    a, b = torch.randn(4, 2), torch.randn(4, 2)
    model = PipeSequential(Add(), nn.Identity())
    piped = Pipe(model, chunks=2)
    torch.testing.assert_close(piped((a, b)), model((a, b)))
    torch.testing.assert_close(piped(a, b), a + b)


def test_plain_sequential_still_passes_one_tuple() -> None:
    class Takes(nn.Module):
        def forward(self, value: tuple) -> torch.Tensor:
            a, b = value
            return a * b

    a, b = torch.randn(4, 2), torch.randn(4, 2)
    piped = Pipe(nn.Sequential(Takes(), nn.Identity()), chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    assert all(type(p) is nn.Sequential for p in piped.partitions)
    torch.testing.assert_close(piped(a, b), a * b)


def test_plain_sequential_rejects_layers_with_several_arguments_naming_pipe_sequential() -> None:
    """What a torch Pipe user meets before wrapping the model in PipeSequential: an error that names it."""
    model = encoder()
    with pytest.raises(TypeError, match=r"layer 0 \(Embed\) takes 3 arguments .*pipe\.PipeSequential"):
        Pipe(nn.Sequential(*model), chunks=2)


def test_slicing_keeps_the_convention_and_the_names() -> None:
    model = encoder()
    piped = Pipe(model, chunks=2, balance=[3, 3], devices=["cpu", "cpu"])
    head = piped[4:]
    assert type(head) is PipeSequential and list(head._modules) == ["4", "5"]
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    torch.testing.assert_close(head(x, mask), model[5](*model[4](x, mask)))


def test_sequential_like() -> None:
    layers = [("a", nn.Identity()), ("b", nn.Identity())]
    assert type(sequential_like(PipeSequential(), layers)) is PipeSequential
    assert type(sequential_like(nn.Sequential(), layers)) is nn.Sequential
    assert list(sequential_like(nn.Sequential(), layers)._modules) == ["a", "b"]


def test_a_skippable_layer_takes_several_arguments_outside_pipe() -> None:
    model = PipeSequential(StashResidual(), AddResidual())
    x, mask = torch.randn(2, 3), torch.ones(2, dtype=torch.bool)
    out, out_mask = model(x, mask)  # stash and pop meet in the thread's default tracker
    torch.testing.assert_close(out, 2 * x)
    assert out_mask is mask


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_policies_on_layers_with_several_arguments(policy: str) -> None:
    model = encoder()
    for index in (1, 4):  # the Attention blocks: forward(self, x, mask) -> (x, mask)
        if policy == "full":
            recompute(model[index])
        else:
            select_recompute(model[index], ops=["softmax", "layer_norm"])
    piped = Pipe(copy.deepcopy(model), chunks=4, checkpoint="never", balance=[3, 3], devices=["cpu", "cpu"])
    _check(piped, model, inputs(8, seed=2), targets(8, seed=2))
    piped.close()
