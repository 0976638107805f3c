"""pipe.split runs each decoder layer as a module of its own (pipe.split_blocks), exactly as the flat graph did."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import pipe
from pipe.split_blocks import SplitBlock, blocks_of, outline
from split_models import gpt2, llama, lm_batch

pytest.importorskip("transformers")


def assert_exact(logits: Tensor, model: nn.Module, reference: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """``logits`` of the split ``model`` and, after a backward of both, every gradient equal ``reference``'s to
    the last bit; returns the reference's logits."""
    expected = reference(ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)
    logits.square().mean().backward()
    expected.square().mean().backward()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.grad, reference.get_parameter(name).grad), name
    return expected.detach()


# Each stage's modules, in the order it calls them. The tied embedding stays as ops: the first stage reads the
# weight under the head's name (torch.export's), outside the head; an untied one is a module too.
EXPECTED = {
    "llama": [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]],
    "llama-untied": [["model.embed_tokens", "model.layers.0", "model.layers.1"],
                     ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]],
    "gpt2": [["transformer.wpe", "transformer.h.0", "transformer.h.1"],
             ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]],
}


def _untied_llama(layers: int) -> nn.Module:
    model = llama(layers=layers)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.mark.parametrize("which, make, at", [("llama", llama, ["model.layers.2"]),
                                             ("llama-untied", _untied_llama, ["model.layers.2"]),
                                             ("gpt2", gpt2, ["transformer.h.2"])])
def test_each_layer_is_a_module_at_its_path_and_the_model_is_exact(which: str, make, at: list[str]) -> None:
    torch.manual_seed(0)
    model = make(layers=4)
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=at)
    found = [[block.path for block in blocks_of(stage)] for stage in stages]
    assert found == EXPECTED[which]
    for stage in stages:
        for block in blocks_of(stage):
            assert stage.get_submodule(block.path) is block  # installed at the layer's path
            assert type(block).__name__ == type(model.get_submodule(block.path)).__name__
            assert any(node.op == "call_module" and node.target == block.path for node in stage.graph.nodes)
            assert not any(node.op == "get_attr" and str(node.target).startswith(block.path + ".")
                           for node in stage.graph.nodes)  # its weights are read inside it only
    assert list(stages.state_dict()) == list(model.state_dict())
    expected = assert_exact(stages(ids, mask), model, reference, ids, mask)
    copied = copy.deepcopy(stages)  # a copy runs its layers as modules too
    assert [[b.path for b in blocks_of(stage)] for stage in copied] == found
    assert all(isinstance(b, SplitBlock) for stage in copied for b in blocks_of(stage))
    assert torch.equal(copied(ids, mask), expected)


def test_a_block_keeps_its_models_class_name_after_a_model_whose_layers_have_the_same_code() -> None:
    # Blocks of the same code share one class (torch.compile guards on it); a Qwen3 norm has a LLaMA norm's code,
    # and a LLaMA split after a Qwen3 in one process still names its norm LlamaRMSNorm (it was Qwen3RMSNorm).
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids, mask, _ = lm_batch()
    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    for model in (qwen3, llama(layers=4)):
        stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.2"])
        names = [(type(block).__name__, type(model.get_submodule(block.path)).__name__)
                 for stage in stages for block in blocks_of(stage)]
        assert any(ours == "LlamaRMSNorm" or ours == "Qwen3RMSNorm" for ours, _ in names), names
        assert all(ours == theirs for ours, theirs in names), names


def test_a_layer_cut_in_two_runs_as_a_module_in_both_stages() -> None:
    torch.manual_seed(0)
    model = llama(layers=3)
    ids, mask, _ = lm_batch()
    expected = model(ids, attention_mask=mask).logits
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.1.mlp"])
    assert [[b.path for b in blocks_of(stage)] for stage in stages] == [
        ["model.layers.0", "model.layers.1"], ["model.layers.1", "model.layers.2", "model.norm", "lm_head"]]
    assert torch.equal(stages(ids, mask), expected)


class ReadsALayerWeight(nn.Module):
    """Reads the first layer's weight outside the layer: that layer stays as ops, the others are outlined."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.layers[0](x)) + self.layers[0].weight.sum()
        for layer in self.layers[1:]:
            x = torch.relu(layer(x))
        return x


def test_a_layer_whose_weight_is_read_outside_it_stays_as_ops() -> None:
    torch.manual_seed(0)
    model = ReadsALayerWeight()
    x = torch.randn(2, 4)
    stages = pipe.split(model, (x,), at=["layers.2"])
    assert [[b.path for b in blocks_of(stage)] for stage in stages] == [["layers.1"], ["layers.2"]]
    assert type(stages[0].get_submodule("layers.0")) is nn.Module  # still the holder its graph reads
    assert torch.equal(stages(x), model(x))
    assert not outline(stages[1], "layers.2")  # once is all: an outlined layer is not outlined again


def test_each_layer_of_a_split_model_can_be_recomputed_on_its_own() -> None:
    """pipe.recompute.recompute(layer) on the outlined layers: backward keeps each layer's input only, exactly."""
    from pipe.recompute import recompute

    torch.manual_seed(0)
    model = llama(layers=4)
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.2"])

    def saved_elements() -> tuple[Tensor, int]:
        count = [0]

        def pack(tensor: Tensor) -> Tensor:
            count[0] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return stages(ids, mask), count[0]

    _, kept = saved_elements()
    for stage in stages:
        for block in blocks_of(stage):
            recompute(block)
    logits, kept_with_recompute = saved_elements()
    assert kept_with_recompute < kept / 4  # 144 768 -> 11 904 elements here
    assert_exact(logits, model, reference, ids, mask)


def _first_add_eps(block: SplitBlock) -> torch.fx.Node:
    return next(node for node in block.graph.nodes if node.op == "call_function"
                and node.target is torch.ops.aten.add.Tensor and isinstance(node.args[1], float))


def test_alike_layers_share_one_class_and_a_changed_layer_leaves_it() -> None:
    """torch.compile guards on a module's class: alike layers share one, so that they compile once
    (tests/test_compile.py); a layer whose graph changes gets a class of its own, the others run as before."""
    torch.manual_seed(0)
    model = llama(layers=4)
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.2"])
    layers = [block for stage in stages for block in blocks_of(stage) if ".layers." in block.path]
    assert len(layers) == 4 and len({type(block) for block in layers}) == 1
    assert len({block.code for block in layers}) == 1  # values named by their place in the layer
    expected = stages(ids, mask)
    layers[1].recompile()  # the same code: back in the shared class
    assert len({type(block) for block in layers}) == 1
    copied = copy.deepcopy(stages)
    assert {type(block) for block in blocks_of(copied[0])} & {type(layers[0])}
    node = _first_add_eps(layers[1])
    node.update_arg(1, 0.5)  # another epsilon in one layer's first norm
    layers[1].recompile()
    assert type(layers[1]) is not type(layers[0]) and type(layers[0]) is type(layers[2]) is type(layers[3])
    assert isinstance(layers[1], SplitBlock) and type(layers[1]).__name__ == type(layers[0]).__name__
    assert not torch.equal(stages(ids, mask), expected)
    assert torch.equal(copied(ids, mask), expected)  # the copy and the other layers run their own code
    node.update_arg(1, model.config.rms_norm_eps)
    layers[1].recompile()
    assert type(layers[1]) is type(layers[0]) and torch.equal(stages(ids, mask), expected)
