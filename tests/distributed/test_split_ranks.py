"""Real models through pipe.split + DistributedPipe on 2 gloo ranks (1F1B) against the plain model.

GPT-2 and LLaMA (padded batches, tied embeddings: the embedding on rank 0
and the LM head on rank 1 are replicas of one weight) and a ResNet-style CNN:
the loss, every gradient, and the weights after optimizer steps.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipe
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import SmallResNet, gpt2, lm_batch, lm_loss, llama, predicted_tokens  # noqa: E402

pytest.importorskip("transformers")

MODELS = {"gpt2": (gpt2, "transformer.h.1"), "llama": (llama, "model.layers.1")}


def _check(piped: DistributedPipe, reference: nn.Module, label: str) -> None:
    """Every parameter of this rank, by its name (the original model's, pipe.distributed.names), against the plain model."""
    for name, parameter in piped.named_parameters():
        expected = reference.get_parameter(name).grad
        torch.testing.assert_close(parameter.grad, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{label} {name}: {m}")


def _language_model(rank: int, world: int, which: str, dynamic: bool) -> float:
    build, cut = MODELS[which]
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch(8 if dynamic else 2, 8)  # captured at static sizes: one micro-batch's shape
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=[cut], dynamic=dynamic)
    piped = DistributedPipe(stages, chunks=4, checkpoint="except_last", schedule="1f1b",
                            loss_reduction="sum")
    optimizer = torch.optim.SGD(piped.parameters(), lr=0.1, momentum=0.9)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        ids, mask, labels = lm_batch(8, 8, seed=step)
        tokens = predicted_tokens(labels)  # the batch's mean over tokens, from per-micro-batch sums
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
        loss = piped.step((ids, mask), labels, lambda logits, y: lm_loss(logits, y, tokens))
        expected = lm_loss(reference(ids, attention_mask=mask).logits, labels)
        expected.backward()
        if piped.is_last:
            torch.testing.assert_close(loss, expected)
        _check(piped, reference, f"{which} step {step}")
        optimizer.step()
        expected_optimizer.step()
    for name, parameter in piped.named_parameters():
        expected = reference.get_parameter(name)
        torch.testing.assert_close(parameter, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{which} {name}: {m}")
    state = piped.state_dict()  # this rank's part of the original model's state dict, under its keys
    assert set(state) <= set(reference.state_dict())
    embedding = "transformer.wte.weight" if which == "gpt2" else "model.embed_tokens.weight"
    assert embedding in state and "lm_head.weight" in state  # both ranks hold the tied weight
    tied = model.get_input_embeddings().weight.detach().clone()  # a replica on each rank
    replicas = [torch.empty_like(tied) for _ in range(world)]
    dist.all_gather(replicas, tied)
    torch.testing.assert_close(replicas[0], replicas[1], rtol=0, atol=0)
    return float(tied.sum())


@pytest.mark.parametrize("which, dynamic", [("gpt2", True), ("llama", True), ("llama", False)])
def test_language_model_over_two_ranks(which: str, dynamic: bool) -> None:
    first, second = run_ranks(_language_model, 2, which, dynamic, deadline=180)
    assert first == second


def _cnn(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = SmallResNet()
    reference = copy.deepcopy(model)
    stages = pipe.split(model, (torch.randn(8, 3, 8, 8),), at=["layer2"])
    # chunks=1: BatchNorm in training mode sees the whole batch, as in the plain model.
    piped = DistributedPipe(stages, chunks=1, checkpoint="always", schedule="1f1b",
                            loss_fn=lambda out, y: (out - y).square().mean())
    assert list(piped.state_dict()) == [key for key in reference.state_dict()
                                        if key.startswith(("layer2", "fc")) == (rank == 1)]
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 8, 8, generator=generator), torch.randn(8, 5, generator=generator)
        piped.zero_grad()
        reference.zero_grad()
        loss = piped.step(x, y)
        expected = (reference(x) - y).square().mean()
        expected.backward()
        if piped.is_last:
            torch.testing.assert_close(loss, expected)
        for name, parameter in piped.named_parameters():
            expected_grad = reference.get_parameter(name).grad
            torch.testing.assert_close(parameter.grad, expected_grad, atol=1e-5, rtol=1e-4)
    for name, value in piped.state_dict().items():  # running statistics included
        torch.testing.assert_close(value, reference.state_dict()[name], atol=1e-6, rtol=1e-5)
    # The original model's whole checkpoint loads on every rank (strict): each takes its stages' part.
    fresh = SmallResNet()
    piped.load_state_dict(fresh.state_dict())
    for name, value in piped.state_dict().items():
        torch.testing.assert_close(value, fresh.state_dict()[name], atol=0, rtol=0)
    return len(piped.state_dict())


def test_cnn_over_two_ranks() -> None:
    assert all(count > 0 for count in run_ranks(_cnn, 2, deadline=180))


def _recompiled_after_fsdp(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipe.split_blocks import blocks_of

    torch.manual_seed(0)
    model = llama(layers=4)
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.2"])
    expected = stages[0](ids, attention_mask=mask)
    layers = blocks_of(stages[0])
    for block in layers:
        fully_shard(block, mesh=init_device_mesh("cpu", (world,)))
    shared = type(layers[0])  # FSDP's class over the blocks' shared one
    assert all(type(block) is shared for block in layers)
    layers[1].recompile()  # fx's call wrapper must not call FSDP's class again (it recursed without end)
    assert type(layers[0]) is shared and isinstance(layers[1], type(layers[0]).__mro__[1])
    got = stages[0](ids, attention_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    got[-1].float().square().mean().backward()
    return all(p.grad is not None for block in layers for p in block.parameters())


def test_a_layer_recompiles_after_fsdp_has_given_it_its_class() -> None:
    """A split layer's graph may change after fully_shard (its class then FSDP's over the layers' shared one):
    the layer recompiles into a class of its own, runs and back-propagates as before."""
    assert run_ranks(_recompiled_after_fsdp, 1, deadline=120) == [True]
