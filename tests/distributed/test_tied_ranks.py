"""Tied weights across the ranks of DistributedPipe: replicas, summed gradients, the plain model's steps."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipe.distributed import DistributedPipe
from dist_models import train_tokens_against
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import VOCAB, tied_model  # noqa: E402


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.logsumexp(-1) - output.gather(-1, target.unsqueeze(-1)).squeeze(-1)).mean()


def _tied_steps(rank: int, world: int) -> list[float]:
    model = tied_model()
    reference = copy.deepcopy(model)
    # Stage 0 (rank 0) holds the embedding, stage 1 (rank 1) the head: the same weight on two ranks.
    piped = DistributedPipe(model, chunks=4, checkpoint="except_last", schedule="1f1b", balance=[2, 3],
                            loss_fn=_loss)
    names = [name for name, _ in piped.named_parameters()]
    assert "0.weight" in names and "4.weight" not in names  # the plain model's name of the tie, on both ranks

    def same_norm() -> None:  # the tied weight counts once, as in the plain model
        norm = piped.clip_grad_norm_(1e9)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))

    train_tokens_against(piped, reference, _loss, 4, lambda params: torch.optim.Adam(params, lr=0.05), VOCAB,
                         between=same_norm)
    for name, value in piped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    replica = piped.get_parameter("0.weight" if rank == 0 else "4.weight").detach().clone()
    replicas = [torch.empty_like(replica) for _ in range(world)]
    dist.all_gather(replicas, replica)
    torch.testing.assert_close(replicas[0], replicas[1], rtol=0, atol=0)  # the replicas stayed equal
    return [float(replica.sum())]


def test_tied_weight_across_ranks_trains_like_the_plain_model() -> None:
    results = run_ranks(_tied_steps, 2)
    assert results[0] == results[1]


def _buffer_across_ranks(rank: int, world: int) -> str:
    first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    second.running_mean = first.running_mean
    try:
        DistributedPipe(nn.Sequential(first, second), balance=[1, 1])
    except ValueError as error:
        return str(error)
    return "no error"


def test_buffer_shared_across_ranks_is_refused() -> None:
    for message in run_ranks(_buffer_across_ranks, 2):
        assert "buffer '0.running_mean' of stage 0 is shared with stage(s) [1] on other ranks" in message
