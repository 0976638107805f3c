"""Real models through pipe.split + Pipe against the plain model: HuggingFace GPT-2 and LLaMA, a ResNet-style CNN.

Two CPU partitions, every checkpoint mode, chunks 1 and 4: the loss, every
gradient, and the weights (tied embeddings included) after optimizer steps.
The language models see padded batches with an attention mask; the loss
ignores the padding.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

import pipe
from pipe import Pipe
from helpers import assert_same_grads
from split_models import (SmallResNet, assert_same_lm_step, assert_same_state, gpt2, lm_batch,
                          llama)

pytest.importorskip("transformers")

CASES = [(1, "never"), (1, "always"), (4, "always"), (4, "except_last"), (4, "never")]
LMS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "transformer.h.1"),
    "llama": (llama, "model.layers.1"),
}


@pytest.fixture(scope="module", params=sorted(LMS))
def split_lm(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Sequential, dict[str, torch.Tensor]]:
    build, cut = LMS[request.param]
    torch.manual_seed(0)
    model = build()
    ids, mask, _ = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=[cut])
    return model, stages, copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("chunks,checkpoint", CASES)
def test_language_model_with_padding_and_tied_embeddings(
        split_lm: tuple[nn.Module, nn.Sequential, dict[str, torch.Tensor]], chunks: int, checkpoint: str) -> None:
    model, stages, initial = split_lm
    model.load_state_dict(initial)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    reference = copy.deepcopy(model)
    piped = Pipe(stages, chunks=chunks, checkpoint=checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # Adam would magnify rounding on tiny grads
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        ids, mask, labels = lm_batch(8, 8, seed=step)
        assert (mask == 0).any()  # padded rows
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
        assert_same_lm_step(piped, model, reference, ids, mask, labels)
        optimizer.step()
        expected_optimizer.step()
    assert_same_state(model, reference, atol=1e-5, rtol=1e-4)
    assert_same_state(stages, reference, atol=1e-5, rtol=1e-4)  # the split model's keys are the original's
    assert_same_state(piped, reference, atol=1e-5, rtol=1e-4)  # and Pipe's
    piped.close()


@pytest.fixture(scope="module", params=[True, False], ids=["train", "eval"])
def split_cnn(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Sequential, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = SmallResNet().train(request.param)
    stages = pipe.split(model, (torch.randn(8, 3, 8, 8),), at=["layer2"])  # layer2 begins with a conv, not an in-place op
    return model, stages, copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("chunks,checkpoint", CASES + [(1, "except_last")])
def test_cnn_with_inplace_relu_and_batchnorm(
        split_cnn: tuple[nn.Module, nn.Sequential, dict[str, torch.Tensor]], chunks: int, checkpoint: str) -> None:
    model, stages, initial = split_cnn
    # BatchNorm in training mode normalises each micro-batch by its own statistics (GPipe
    # semantics): the oracle is then the plain model run on each micro-batch in turn.
    per_microbatch = model.training and chunks > 1
    model.load_state_dict(initial)
    reference = copy.deepcopy(model)
    piped = Pipe(stages, chunks=chunks, checkpoint=checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    for step in range(2):
        x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        reference.zero_grad()
        output = piped(x)
        expected = torch.cat([reference(part) for part in x.tensor_split(chunks)]) if per_microbatch \
            else reference(x)
        torch.testing.assert_close(output, expected)
        output.square().mean().backward()
        expected.square().mean().backward()
        assert_same_grads(model, reference, atol=1e-5, rtol=1e-4)
    # Running statistics (updated once per forward in training, not again under recomputation) equal the plain model's.
    assert_same_state(piped, reference, atol=1e-6, rtol=1e-5)
    piped.close()


def test_deferred_batch_norm_is_refused_for_captured_batch_norm(
        split_cnn: tuple[nn.Module, nn.Sequential, dict[str, torch.Tensor]]) -> None:
    model, stages, _ = split_cnn
    if not model.training:  # running statistics are only read: nothing to defer
        Pipe(stages, chunks=4, balance=[1, 1], devices=["cpu", "cpu"], deferred_batch_norm=True).close()
        return
    with pytest.raises(ValueError, match=r"deferred_batch_norm cannot reach the batch norm captured"):
        Pipe(stages, chunks=4, balance=[1, 1], devices=["cpu", "cpu"], deferred_batch_norm=True)


def test_llama_rotary_tables_are_made_again_in_each_stage_from_a_copy_of_inv_freq() -> None:
    # cos and sin ([1, s, head_dim] each, per micro-batch) come from the inv_freq buffer (outside the state
    # dict, never written) and the positions: each stage makes them from its own copy instead of receiving them.
    torch.manual_seed(0)
    model = LMS["llama"][0](layers=3)
    ids, mask, _ = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False},
                        at=["model.layers.1", "model.layers.2"])
    for k, stage in enumerate(stages):
        floats = [tuple(n.meta["val"].shape) for n in stage.graph.nodes
                  if n.op == "placeholder" and n.meta["val"].is_floating_point()]
        assert len(floats) == (0 if k == 0 else 1), f"stage {k} receives {floats}: the hidden state alone expected"
    copies = [stage.get_buffer("model.rotary_emb.inv_freq") for stage in stages]
    assert copies[0] is model.model.rotary_emb.inv_freq
    assert len({c.data_ptr() for c in copies}) == 3 and all(torch.equal(c, copies[0]) for c in copies)
    assert sorted(stages.state_dict()) == sorted(model.state_dict())  # inv_freq is in neither
    ids, mask, labels = lm_batch(4, 6, seed=1)
    piped = Pipe(stages, chunks=2, checkpoint="except_last", balance=[1, 1, 1], devices=["cpu"] * 3)
    assert_same_lm_step(piped, model, copy.deepcopy(model), ids, mask, labels)
    piped.close()


@pytest.mark.parametrize("which", sorted(LMS))
def test_a_mask_made_from_the_inputs_is_made_again_in_each_stage_not_sent(which: str) -> None:
    # The [b, 1, s, s] mask the model expands from attention_mask would cross every boundary (s x s bytes
    # per sample); each stage makes it again from attention_mask, which crosses anyway.
    build, cut = LMS[which]
    torch.manual_seed(0)
    model = build(layers=3)
    ids, mask, _ = lm_batch(8, 8)
    prefix = cut.rsplit(".", 1)[0]
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False},
                        at=[f"{prefix}.1", f"{prefix}.2"])
    for k, stage in enumerate(stages):
        sent = [n.meta["val"] for n in stage.graph.nodes if n.op == "placeholder"]
        assert not [v for v in sent if v.dim() == 4], f"stage {k} receives a 4-D tensor: {[v.shape for v in sent]}"
    ids, mask, labels = lm_batch(4, 6, seed=1)  # other sizes than the capture's: the mask is made for them
    assert (mask == 0).any()
    piped = Pipe(stages, chunks=2, checkpoint="except_last", balance=[1, 1, 1], devices=["cpu"] * 3)
    assert_same_lm_step(piped, model, copy.deepcopy(model), ids, mask, labels)
    piped.close()
