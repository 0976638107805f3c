"""In-place layers at a partition's start (pipe.core.inplace) against the plain module.

A VGG-like CNN with in-place ReLUs and BatchNorm is cut at every position,
in every checkpoint mode, with 1 and 4 micro-batches, with inputs that are a
leaf not requiring grad, a leaf requiring grad and a non-leaf, through the
worker backward of CPU partitions and through autograd's own backward. The
oracle runs the plain module on each micro-batch (BatchNorm normalises each
micro-batch with its own statistics in a pipeline, as in the plain module fed
that micro-batch) and concatenates.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import Tensor, nn

from pipe import Pipe
from pipe.balance import balance_by_size, balance_by_time
from pipe.core.inplace import InputGuard, own, unalias, verify_unmodified, versions_of
from pipe.core.microbatch import Batch

CHECKPOINTS = ("always", "except_last", "never")


def vgg() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 2 * 2, 8), nn.ReLU(inplace=True), nn.Dropout(0.0), nn.Linear(8, 3),
    )


def _inputs(kind: str) -> tuple[Tensor, Tensor, Callable[[], Tensor]]:
    """(input for the pipe, input for the oracle, the leaf whose grad to compare) of one kind."""
    data = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    if kind == "no_grad":
        return data.clone(), data.clone(), lambda: torch.zeros(())
    a = data.clone().requires_grad_()
    b = data.clone().requires_grad_()
    if kind == "leaf":
        return a, b, lambda: torch.stack([a.grad, b.grad])
    return a * 1, b * 1, lambda: torch.stack([a.grad, b.grad])  # a non-leaf input


def _check(model: nn.Sequential, balance: list[int], checkpoint: str, chunks: int, kind: str,
           worker_backward: bool = True) -> None:
    label = f"balance={balance} checkpoint={checkpoint} chunks={chunks} input={kind} worker_backward={worker_backward}"
    piped_model, plain = copy.deepcopy(model), copy.deepcopy(model)
    x, y, grads = _inputs(kind)
    piped = Pipe(piped_model, chunks=chunks, checkpoint=checkpoint, balance=balance, devices=["cpu"] * len(balance))
    piped._pipeline.worker_backward = piped._pipeline.worker_backward and worker_backward
    output = piped(x)
    (output * torch.arange(output.numel()).reshape(output.shape)).sum().backward()
    # Each micro-batch a tensor of its own: slices of one share its version counter.
    expected = torch.cat([plain(part.clone()) for part in y.tensor_split(chunks)])
    (expected * torch.arange(expected.numel()).reshape(expected.shape)).sum().backward()
    torch.testing.assert_close(output, expected, msg=lambda m: f"{label}: output\n{m}")
    for (name, p), q in zip(piped_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{label}: {name}\n{m}")
    if kind != "no_grad":
        pair = grads()
        torch.testing.assert_close(pair[0], pair[1], msg=lambda m: f"{label}: input grad\n{m}")


@pytest.mark.parametrize("cut", range(1, 11))
def test_vgg_cut_at_every_position(cut: int) -> None:
    model = vgg()
    balance = [cut, len(model) - cut]
    kinds = ("no_grad", "leaf", "non_leaf")
    for k, checkpoint in enumerate(CHECKPOINTS):
        _check(model, balance, checkpoint, 1, kinds[(cut + k) % 3])
        _check(model, balance, checkpoint, 4, kinds[(cut + k + 1) % 3])
    # Autograd's own backward (as on CUDA devices), not the workers'.
    _check(model, balance, "except_last", 4, "leaf", worker_backward=False)


def test_cut_before_every_inplace_layer_of_three_partitions() -> None:
    model = vgg()
    for checkpoint in CHECKPOINTS:
        _check(model, [2, 2, 7], checkpoint, 4, "non_leaf")
        _check(model, [4, 4, 3], checkpoint, 2, "leaf")


@pytest.mark.parametrize("partitions", [1, 2])
def test_first_layer_inplace(partitions: int) -> None:
    """The pipeline's first layer modifies the input: a non-leaf, or a tensor that does not require grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    balance = [len(model)] if partitions == 1 else [1, len(model) - 1]
    for checkpoint in CHECKPOINTS:
        for chunks in (1, 4):
            for kind in ("no_grad", "non_leaf"):
                _check(model, balance, checkpoint, chunks, kind)


@pytest.mark.parametrize("passthrough", [nn.Identity, nn.Flatten])
def test_partition_returning_its_input_before_an_inplace_layer(passthrough: Callable[[], nn.Module]) -> None:
    """A partition whose output is its input (or a view of it): the next one's in-place layer must not reach
    the caller's tensor or the kept replay input."""
    torch.manual_seed(0)
    model = nn.Sequential(passthrough(), nn.LeakyReLU(0.1, inplace=True), nn.Linear(5, 6),
                          passthrough(), nn.ELU(inplace=True), nn.Linear(6, 2))
    for checkpoint in CHECKPOINTS:
        for worker_backward in (True, False):
            _check_linear(model, [1, 2, 1, 2], checkpoint, 4, worker_backward)


class AddInPlace(nn.Module):
    """Not idempotent: replaying it on its own output would add twice."""

    def forward(self, x: Tensor) -> Tensor:
        return x.add_(1.0)


@pytest.mark.parametrize("layer", [lambda: nn.LeakyReLU(0.1, inplace=True), lambda: nn.ELU(inplace=True),
                                   AddInPlace])
def test_recomputation_replays_the_original_input(layer: Callable[[], nn.Module]) -> None:
    """A partition whose first layer is not idempotent: the checkpoint keeps its input intact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), layer(), nn.Linear(6, 6), layer(), nn.Linear(6, 2))
    for checkpoint in ("always", "except_last"):
        for chunks in (1, 4):
            for worker_backward in (True, False):
                _check_linear(model, [1, 2, 2], checkpoint, chunks, worker_backward)


def _check_linear(model: nn.Sequential, balance: list[int], checkpoint: str, chunks: int,
                  worker_backward: bool = True) -> Pipe:
    label = f"balance={balance} checkpoint={checkpoint} chunks={chunks} worker_backward={worker_backward}"
    piped_model, plain = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    piped = Pipe(piped_model, chunks=chunks, checkpoint=checkpoint, balance=balance, devices=["cpu"] * len(balance))
    piped._pipeline.worker_backward = piped._pipeline.worker_backward and worker_backward
    output = piped(x)
    output.pow(2).sum().backward()
    expected = plain(x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(output, expected, msg=lambda m: f"{label}: output\n{m}")
    for (name, p), q in zip(piped_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{label}: {name}\n{m}")
    return piped


def test_only_partitions_that_modify_their_input_copy_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    piped = _check_linear(model, [2, 1, 2], "always", 4)
    assert [guard.modified for guard in piped._pipeline.input_guards] == [frozenset(), frozenset(), {0}]
    assert "partition 2 (first layer '3': ReLU)" == piped._pipeline.input_guards[2].where


class SometimesInPlace(nn.Module):
    """Modifies its input in place only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.inplace = False

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2.0) if self.inplace else x * 2.0


def test_a_partition_that_starts_modifying_its_input_fails_loudly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), SometimesInPlace(), nn.Linear(6, 2))
    piped_model = copy.deepcopy(model)
    piped = Pipe(piped_model, chunks=2, checkpoint="always", balance=[1, 2], devices=["cpu", "cpu"])
    x = torch.randn(4, 5)
    piped(x).sum().backward()
    piped_model[1].inplace = model[1].inplace = True
    with pytest.raises(RuntimeError, match=r"partition 1 \(first layer '1': SometimesInPlace\) modified its input"):
        piped(x)
    # The next step copies that input first and is exact.
    piped_model.zero_grad()
    output = piped(x)
    output.sum().backward()
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(output, expected)
    for p, q in zip(piped_model.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_an_evaluation_pass_does_not_vouch_for_training() -> None:
    """In-place dropout modifies its input in training only: what eval learned does not refuse training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5, inplace=True), nn.Linear(6, 2))
    piped_model = copy.deepcopy(model)
    piped = Pipe(piped_model, chunks=1, checkpoint="always", balance=[1, 2], devices=["cpu", "cpu"])
    x = torch.randn(4, 5)
    piped.eval()
    with torch.no_grad():
        torch.testing.assert_close(piped(x), model.eval()(x))
    piped.train()
    model.train()
    torch.manual_seed(1)
    output = piped(x)
    output.sum().backward()
    torch.manual_seed(1)
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(output, expected)
    for p, q in zip(piped_model.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_own_shares_memory_and_passes_the_gradient() -> None:
    leaf = torch.randn(3, 4, requires_grad=True)
    mask = torch.ones(3, dtype=torch.bool)
    batch = own(Batch((leaf.tensor_split(3)[1], mask)))
    x, same_mask = batch.value
    assert same_mask is mask  # no grad: passed as it is
    assert not x.is_leaf and not x._is_view() and x.data_ptr() == leaf[1].data_ptr()
    x.relu_().mul(3.0).sum().backward()
    expected = torch.zeros(3, 4)
    expected[1] = (leaf.detach()[1] > 0).float() * 3.0
    torch.testing.assert_close(leaf.grad, expected)
    with torch.no_grad():
        assert own(Batch(leaf)).value is leaf


def test_guard_keeps_the_replay_input_and_copies_only_what_is_modified() -> None:
    guard = InputGuard("partition 1")
    ids = torch.arange(4)

    def function(batch: Batch) -> Batch:
        x, ids = batch.value
        return Batch(x.relu_() + ids)

    x = torch.randn(4)
    original = x.clone()
    with torch.no_grad():
        _, kept = guard.checkpoint(function, Batch((x, ids)))  # learning: copies every input
        assert guard.modified == {0}
        torch.testing.assert_close(kept.value[0], original)
        assert kept.value[0] is not x and kept.value[1] is not ids
        x = torch.randn(4)
        original = x.clone()
        _, kept = guard.checkpoint(function, Batch((x, ids)))  # knows: copies only x
        torch.testing.assert_close(kept.value[0], original)
        assert kept.value[1] is ids


@pytest.mark.parametrize("balancer", ["time", "size"])
def test_balancers_profile_inplace_layers(balancer: str) -> None:
    """The balancers' profiling runs each layer on an owned input, so in-place layers profile too."""
    model = nn.Sequential(nn.LeakyReLU(0.1, inplace=True), *vgg())  # the first layer modifies the sample
    before = copy.deepcopy(model.state_dict())
    sample = torch.randn(4, 3, 4, 4)
    original = sample.clone()
    if balancer == "time":
        balance = balance_by_time(2, model, sample, timeout=0.05)
    else:
        balance = balance_by_size(2, model, sample, chunks=2)
    assert sum(balance) == len(model) and len(balance) == 2
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    torch.testing.assert_close(sample, original)
    _check(model, balance, "except_last", 2, "non_leaf")


def test_unalias_copies_only_outputs_sharing_memory_with_the_input() -> None:
    x = torch.randn(4, 3)
    other = torch.randn(4)
    output = unalias(Batch((x.view(-1), other)), [x])
    flat, same = output.value
    assert same is other and flat.data_ptr() != x.data_ptr()
    torch.testing.assert_close(flat, x.view(-1))


def test_a_modified_replay_input_is_refused() -> None:
    kept = [torch.randn(3)]
    versions = versions_of(kept)
    verify_unmodified(kept, versions, "the cell (0, 1)")
    kept[0].add_(1)
    with pytest.raises(RuntimeError, match=r"recompute the cell \(0, 1\) in backward were modified in place"):
        verify_unmodified(kept, versions, "the cell (0, 1)")
