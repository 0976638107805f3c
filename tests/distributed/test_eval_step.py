"""``DistributedPipe.eval_step``: forwards only through every schedule, the loss equal to the plain model's.

The plain model under ``torch.no_grad()`` in ``eval()`` mode is the oracle: the loss with
``loss_reduction`` "mean" and "count" (a token mean over padded rows), the last stage's output,
no gradient and no graph, on 2 gloo ranks; then data parallel (2 replicas of a 1-rank pipeline).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipe.distributed import DistributedPipe, make_mesh
from spawn_ranks import run_ranks

VOCAB, WIDTH = 20, 16
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1))


class Block(nn.Module):
    """A pre-norm residual MLP block with dropout (off in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln(x)))))


def language_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[Block() for _ in range(6)], nn.Linear(WIDTH, VOCAB))


def mean_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def counted_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def data(size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, 7), generator=generator)
    padded = tokens.clone()
    padded[1::3, 4:] = -100  # rows with fewer real tokens: micro-batch means are not the batch's
    return tokens, tokens.roll(-1, dims=1), padded


def _every_schedule(rank: int, world: int) -> int:
    plain = language_model().eval()
    tokens, labels, padded = data(10, 1)  # 10 rows in 4 micro-batches: 3, 3, 2, 2
    with torch.no_grad():
        expected_output = plain(tokens)
        expected = {"mean": mean_loss(expected_output, labels),
                    "count": F.cross_entropy(expected_output.flatten(0, 1), padded.flatten(), ignore_index=-100)}
    checked = 0
    for schedule, virtual in SCHEDULES:
        for reduction, loss_fn, target in (("mean", mean_loss, labels), ("count", counted_loss, padded)):
            model = DistributedPipe(copy.deepcopy(plain), chunks=4, schedule=schedule, virtual_stages=virtual,
                                    loss_reduction=reduction, loss_fn=loss_fn, checkpoint="always").eval()
            where = f"{schedule}/{reduction}"
            loss, output = model.eval_step(tokens, target, return_outputs=True)
            if model.is_last:
                assert loss is not None and not loss.requires_grad, where
                torch.testing.assert_close(loss, expected[reduction], msg=where)
                torch.testing.assert_close(output, expected_output, msg=where)
            else:
                assert loss is None and output is None, where
            assert all(p.grad is None for p in model.parameters()), f"{where}: eval_step touched a gradient"
            shared = model.eval_step(tokens, target, broadcast_loss=True)
            torch.testing.assert_close(shared, expected[reduction], msg=f"{where} broadcast")
            checked += 1
        # No target: the outputs only.
        loss, output = model.eval_step(tokens, return_outputs=True)
        assert loss is None
        if model.is_last:
            torch.testing.assert_close(output, expected_output)
    # Training still works after evaluating (eval mode: dropout off, so the loss is the plain one).
    train_loss = model.step(tokens, padded, broadcast_loss=True)
    torch.testing.assert_close(train_loss, expected["count"])
    assert any(p.grad is not None for p in model.parameters())
    return checked


def test_eval_step_equals_plain_loss_in_every_schedule() -> None:
    assert run_ranks(_every_schedule, 2, deadline=240) == [10, 10]


def _data_parallel(rank: int, world: int) -> int:
    plain = language_model().eval()
    tokens, labels, padded = data(16, 2)
    mine = slice(8 * rank, 8 * rank + 8)  # each replica its own half of the global batch
    with torch.no_grad():
        logits = plain(tokens)
        expected = {"mean": mean_loss(logits, labels),
                    "count": F.cross_entropy(logits.flatten(0, 1), padded.flatten(), ignore_index=-100)}
    mesh = make_mesh(pp=1, dp_replicate=2)
    for reduction, loss_fn, target in (("mean", mean_loss, labels), ("count", counted_loss, padded)):
        model = DistributedPipe(copy.deepcopy(plain), chunks=2, mesh=mesh, loss_reduction=reduction,
                                loss_fn=loss_fn).eval()
        loss = model.eval_step(tokens[mine], target[mine])
        torch.testing.assert_close(loss, expected[reduction], msg=reduction)  # the global batch's
    return 2


def test_eval_step_with_data_parallel_is_the_global_batch_loss() -> None:
    assert run_ranks(_data_parallel, 2) == [2, 2]
