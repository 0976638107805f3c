"""``DistributedPipe.named_parameters()``, ``named_buffers()`` and ``named_modules()`` use the plain model's names.

On 2 gloo ranks: an ``nn.Sequential`` whose embedding and head share one weight across the ranks,
and a GPT-2 cut by ``pipe.split`` (tied embeddings). Each rank's names are the plain model's names
of the same tensors (equal values), the tied weight is named as the plain model names it on both
ranks, and together the ranks name every parameter of the plain model.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipe
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks


def tied_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    embedding, head = nn.Embedding(12, 8), nn.Linear(8, 12, bias=False)
    head.weight = embedding.weight  # one weight: plain named_parameters() calls it "0.weight"
    return nn.Sequential(embedding, nn.LayerNorm(8), nn.Linear(8, 8), nn.BatchNorm1d(7), head)


def gpt2_split() -> tuple[nn.Module, nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    ids = torch.randint(0, 64, (2, 8))
    return model, pipe.split(copy.deepcopy(model), (ids,), {"use_cache": False}, at=["transformer.h.1"])


def _check(model: DistributedPipe, plain: nn.Module, where: str) -> list[str]:
    expected = dict(plain.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    for name, parameter in model.named_parameters():
        assert name in expected, f"{where}: {name!r} is not a parameter name of the plain model"
        torch.testing.assert_close(parameter, expected[name], msg=f"{where}: {name}")
    assert len(set(names)) == len(names), f"{where}: a name twice: {names}"
    assert [n for n, _ in model.named_parameters(prefix="m")] == [f"m.{n}" for n in names]
    plain_buffers = dict(plain.named_buffers())
    for name, buffer in model.named_buffers():
        assert name in plain_buffers, f"{where}: buffer {name!r} is not the plain model's"
    plain_modules = {name for name, _ in plain.named_modules()}
    modules = [name for name, _ in model.named_modules()]
    assert modules[0] == "" and set(modules) <= plain_modules, f"{where}: {set(modules) - plain_modules}"
    assert sorted(model.state_dict()) == sorted(k for k in plain.state_dict() if k in model.state_dict())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    assert set().union(*everyone) == set(expected), f"{where}: the ranks together miss " \
                                                   f"{set(expected) - set().union(*everyone)}"
    return names


def _names(rank: int, world: int) -> int:
    plain = tied_sequential()
    model = DistributedPipe(copy.deepcopy(plain), chunks=2, balance=[2, 3])
    names = _check(model, plain, "sequential")
    assert "0.weight" in names and "4.weight" not in names  # the tied weight, on both ranks
    assert ("3.running_mean" in dict(model.named_buffers())) == (rank == 1)

    original, stages = gpt2_split()
    model = DistributedPipe(stages, chunks=2)
    names = _check(model, original, "gpt2")
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied, on both ranks
    decay = [n for n, p in model.named_parameters() if p.dim() >= 2]  # optimizer groups by name work
    assert all(not n.endswith("bias") and ".ln_" not in n for n in decay)
    return 1


def test_names_are_the_plain_models() -> None:
    assert run_ranks(_names, 2, deadline=180) == [1, 1]
