"""Token-normalised losses (pipe.distributed.loss): a padded token batch against the plain module.

The plain module's loss is ``F.cross_entropy(..., ignore_index=-100)`` over
the whole batch: a mean over the real tokens, which the micro-batches do not
split evenly. ``loss_reduction="count"`` with a loss returning ``(sum, count)``
gives exactly that loss and its gradients, on 2 gloo ranks as two stages and
as two data-parallel replicas; ``"mean"`` warns.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipe.distributed.loss import CountedLoss, StepGradients, warn_if_ignored_targets
from pipe.distributed import DistributedPipe, make_mesh
from spawn_ranks import run_ranks

VOCAB, WIDTH, LENGTH = 11, 8, 6


def language_model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, VOCAB))


def padded_batch(size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Tokens and labels; row b has a length falling with b, the rest is padding (-100): uneven micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    for row in range(size):
        labels[row, max(1, LENGTH - row):] = -100
    return tokens, labels


def token_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def token_mean(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def oracle(model: nn.Sequential, batches: list[tuple[Tensor, Tensor]]) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Each batch's plain token-mean loss, and the gradients accumulated over the batches."""
    plain = copy.deepcopy(model)
    losses = []
    for tokens, labels in batches:
        loss = token_mean(plain(tokens), labels)
        loss.backward()
        losses.append(loss.detach())
    return losses, {name: p.grad.clone() for name, p in plain.named_parameters()}


def _check(pipe: DistributedPipe, losses: list[Tensor], expected_losses: list[Tensor],
           grads: dict[str, Tensor], label: str) -> None:
    for loss, expected in zip(losses, expected_losses):
        torch.testing.assert_close(loss, expected, msg=lambda m: f"{label}: loss\n{m}")
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name], msg=lambda m: f"{label}: {name}\n{m}")


def _token_losses(rank: int, world: int) -> list[str]:
    model = language_model()
    batches = [padded_batch(10, 0), padded_batch(7, 1)]
    checked = []
    # Two stages: every schedule and checkpoint mode; two steps accumulate (no zero_grad between them).
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("always", "except_last", "never"):
            pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                   loss_fn=token_sum, loss_reduction="count")
            losses = [pipe.step(tokens, labels, broadcast_loss=True) for tokens, labels in batches]
            expected_losses, grads = oracle(model, batches)
            _check(pipe, losses, expected_losses, grads, f"{schedule}/{checkpoint}")
            checked.append(f"{schedule}/{checkpoint}")
    # Interleaved: the last stage is the second rank's second virtual stage.
    pipe = DistributedPipe(copy.deepcopy(model), chunks=4, schedule="interleaved", virtual_stages=2,
                           balance=[2, 1, 2, 1], loss_fn=token_sum, loss_reduction="count")
    losses = [pipe.step(tokens, labels, broadcast_loss=True) for tokens, labels in batches]
    _check(pipe, losses, *oracle(model, batches), "interleaved")
    checked.append("interleaved")
    # Two replicas of a one-stage pipeline, each with part of the global batch: the global batch's token mean.
    tokens, labels = batches[0]
    pipe = DistributedPipe(copy.deepcopy(model), chunks=2, mesh=make_mesh(pp=1, dp_replicate=2), loss_fn=token_sum,
                           loss_reduction="count")
    rows = slice(0, 6) if pipe.topology.replica == 0 else slice(6, 10)  # 6 rows with many tokens, 4 with few
    loss = pipe.step(tokens[rows], labels[rows])
    expected_losses, grads = oracle(model, [(tokens, labels)])
    _check(pipe, [loss], expected_losses, grads, "data parallel")
    checked.append("data parallel")
    # A step whose every target is ignored: ValueError on every rank, gradients as they were, the pipeline usable.
    pipe = DistributedPipe(copy.deepcopy(model), chunks=2, loss_fn=token_sum, loss_reduction="count")
    pipe.step(tokens, labels)
    before = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    with pytest.raises(ValueError, match="counted 0 items"):
        pipe.step(tokens, torch.full_like(labels, -100))
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(parameter.grad, before[name])
    pipe.zero_grad()
    loss = pipe.step(tokens, labels, broadcast_loss=True)
    _check(pipe, [loss], *oracle(model, [(tokens, labels)]), "after a count of 0")
    checked.append("count of 0")
    # "mean" on the same batch: not the token mean, and it says so.
    pipe = DistributedPipe(copy.deepcopy(model), chunks=4, loss_fn=token_mean, loss_reduction="mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = pipe.step(tokens, labels, broadcast_loss=True)
        pipe.step(tokens, labels)
    ours = [w for w in caught if "ignore_index" in str(w.message)]
    if pipe.is_last:
        assert len(ours) == 1, [str(w.message) for w in caught]  # once per pipeline
        assert not torch.allclose(loss, expected_losses[0])
    checked.append("mean warns")
    return checked


def test_token_mean_over_padded_batch_matches_plain_module() -> None:
    results = run_ranks(_token_losses, 2, deadline=120.0)
    assert results[0] == results[1] and len(results[0]) == 10


def test_counted_loss_checks_what_loss_fn_returns() -> None:
    logits = torch.randn(2, LENGTH, VOCAB, requires_grad=True)
    _, labels = padded_batch(2, 0)
    counted = CountedLoss(token_sum)
    total = counted(logits, labels)
    counted(logits, labels)
    assert total.requires_grad and float(counted.total(torch.device("cpu"))) == 2 * float((labels != -100).sum())
    with pytest.raises(TypeError, match=r"must return \(sum, count\), got a tensor of shape \(\)"):
        CountedLoss(token_mean)(logits, labels)
    with pytest.raises(TypeError, match="count of shape"):
        CountedLoss(lambda o, t: (o.sum(), t != -100))(logits, labels)
    total = CountedLoss(lambda o, t: (o.sum(), 3))(logits, labels)
    assert float(total.detach()) == pytest.approx(float(logits.detach().sum()))


def test_step_gradients_scale_only_this_step() -> None:
    layer = nn.Linear(2, 1)
    layer.weight.grad = torch.ones(1, 2)
    earlier = layer.weight.grad
    step = StepGradients(layer)
    assert layer.weight.grad is None
    layer(torch.ones(3, 2)).sum().backward()  # weight grad 3, bias grad 3
    step.finish(0.5)
    assert layer.weight.grad is earlier
    torch.testing.assert_close(layer.weight.grad, torch.full((1, 2), 2.5))
    torch.testing.assert_close(layer.bias.grad, torch.tensor([1.5]))
    step = StepGradients(layer)
    layer(torch.ones(3, 2)).sum().backward()
    step.abandon()
    torch.testing.assert_close(layer.weight.grad, torch.full((1, 2), 2.5))


def test_warns_only_for_mean_with_ignored_targets() -> None:
    _, labels = padded_batch(4, 0)
    with pytest.warns(UserWarning, match="loss_reduction='count'"):
        assert warn_if_ignored_targets("mean", (labels, {"mask": torch.ones(4, dtype=torch.bool)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_ignored_targets("count", labels)
        assert not warn_if_ignored_targets("mean", labels.clamp(min=0))
        assert not warn_if_ignored_targets("mean", torch.full((4,), -100.0))  # float targets: a regression


def test_a_tuple_under_mean_names_count() -> None:
    from pipe.distributed.loss import micro_batch_loss

    logits = torch.randn(2, LENGTH, VOCAB)
    _, labels = padded_batch(2, 0)
    with pytest.raises(TypeError, match="loss_reduction='count'"):
        micro_batch_loss(token_sum, logits, labels, 0)
