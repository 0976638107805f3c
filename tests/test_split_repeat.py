"""pipe.split captures two alike layers and repeats the second's graph (pipe.split_repeat): the same graph as
exporting every layer, op by op, on real HF models; the same outputs and gradients, bit for bit; and the whole
export wherever the layers may differ."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import fx, nn

import pipe
import pipe.graph_split as graph_split
from pipe.split_blocks import SplitBlock
from split_models import VOCAB, gpt2, lm_batch, llama

pytest.importorskip("transformers")


def qwen2(layers: int = 4, **settings: Any) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, **settings)
    return Qwen2ForCausalLM(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], str, list[str]]] = {
    "llama": (lambda: llama(layers=5), "model.layers", ["model.layers.3"]),
    "qwen2": (lambda: qwen2(layers=5), "model.layers", ["model.layers.1", "model.layers.4"]),
    "gpt2": (lambda: gpt2(layers=5), "transformer.h", ["transformer.h.2"]),
}


@pytest.fixture
def exported_layers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many layers each torch.export call of pipe.split saw."""
    seen: list[int] = []
    export = graph_split._export

    def counting(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        stack = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)
        seen.append(len(stack))
        return export(model, *args, **kwargs)
    monkeypatch.setattr(graph_split, "_export", counting)
    return seen


def canonical(graph: fx.Graph) -> list[tuple[Any, ...]]:
    """Each node as (op, target, arguments with other nodes by position): equal for the same graph, whatever
    the nodes' names."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    return [(node.op, str(node.target) if node.op != "placeholder" else "",
             repr(fx.node.map_arg((node.args, node.kwargs), lambda arg: f"%{position[arg]}")))
            for node in graph.nodes]


def graphs(stages: nn.Module) -> list[list[tuple[Any, ...]]]:
    return [canonical(module.graph) for module in stages.modules() if isinstance(module, fx.GraphModule)]


def split(model: nn.Module, at: list[str], repeat: bool = True) -> nn.Module:
    ids, mask, _ = lm_batch(4, 8)
    return pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=at, repeat=repeat)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_layers_are_exported_and_the_graph_equals_the_whole_export(name: str,
                                                                       exported_layers: list[int]) -> None:
    build, _, at = MODELS[name]
    torch.manual_seed(0)
    model = build()
    repeated = split(model, at)
    assert exported_layers == [2]
    whole = split(model, at, repeat=False)
    assert exported_layers == [2, 5]
    assert graphs(repeated) == graphs(whole)
    blocks = [block.path for block in repeated.modules() if isinstance(block, SplitBlock)]
    assert blocks == [block.path for block in whole.modules() if isinstance(block, SplitBlock)]
    assert len(repeated) == len(at) + 1
    assert repeated.state_dict().keys() == model.state_dict().keys()

    ids, mask, labels = lm_batch(4, 8, seed=1)
    reference = copy.deepcopy(model)
    expected = reference(ids, attention_mask=mask).logits
    results = []
    for stages in (repeated, whole):
        model.zero_grad()
        logits = stages(ids, mask)
        logits.logsumexp(-1).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], expected, rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for got, other in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, other, rtol=0, atol=0)
    expected.logsumexp(-1).sum().backward()
    for parameter, got in zip(reference.parameters(), results[0][1]):
        torch.testing.assert_close(got, parameter.grad, rtol=0, atol=0)


def test_a_meta_model_and_auto_cut_take_the_repeated_path(exported_layers: list[int]) -> None:
    with torch.device("meta"):
        model = llama(layers=6)
    ids = torch.zeros(2, 8, dtype=torch.long)
    stages = pipe.split(model, (ids,), {"use_cache": False}, at="auto", stages=3)
    assert exported_layers[-1] == 2  # the automatic cut counts FLOPs without export; the capture saw 2 layers
    assert len(stages) == 3
    assert sum(p.numel() for p in stages.parameters()) == sum(p.numel() for p in model.parameters())


def test_a_cut_before_a_module_outside_the_layers_is_marked_by_the_export(exported_layers: list[int]) -> None:
    torch.manual_seed(0)
    model = llama(layers=4)
    repeated = split(model, ["model.layers.2", "model.norm"])
    whole = split(model, ["model.layers.2", "model.norm"], repeat=False)
    assert exported_layers == [2, 4]
    assert graphs(repeated) == graphs(whole)


def test_layers_that_differ_are_exported_whole(exported_layers: list[int]) -> None:
    torch.manual_seed(0)
    mixed = qwen2(layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert set(mixed.config.layer_types) == {"sliding_attention", "full_attention"}
    stages = split(mixed, ["model.layers.2"])
    assert exported_layers == [4]
    ids, mask, _ = lm_batch(4, 8, seed=1)
    torch.testing.assert_close(stages(ids, mask), mixed(ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_a_layer_with_hooks_is_exported_whole(exported_layers: list[int]) -> None:
    torch.manual_seed(0)
    model = llama(layers=4)
    model.model.layers[3].mlp.register_forward_hook(lambda module, args, output: output * 2)
    stages = split(model, ["model.layers.2"])
    assert exported_layers == [4]
    ids, mask, _ = lm_batch(4, 8, seed=1)
    torch.testing.assert_close(stages(ids, mask), model(ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_a_model_of_two_layers_and_a_forward_that_counts_its_layers_export_whole(
        exported_layers: list[int]) -> None:
    torch.manual_seed(0)
    split(llama(layers=2), ["model.layers.1"])
    assert exported_layers == [2]

    class Indexed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(4):  # indexes past the two layers the short export keeps: that export fails
                x = self.layers[i](x)
            return x

    model = Indexed()
    stages = pipe.split(model, (torch.randn(2, 4),), at=["layers.2"])
    assert exported_layers[1:] == [2, 4]
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_repeat_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="repeat must be True or False, got 'yes'"):
        split(llama(layers=3), ["model.layers.1"], repeat="yes")  # type: ignore[arg-type]


def test_a_config_that_sets_the_layers_apart_is_named() -> None:
    from pipe.split_repeat import _per_layer_settings

    mixed = qwen2(layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert "layer_types" in _per_layer_settings(mixed.config, 4)
    assert _per_layer_settings(qwen2(layers=4).config, 4) == ""


ARCHITECTURES = {  # name: (config class, model class, config settings, whether the layers are alike)
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, True),  # fused qkv and gate-up projections
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}, False),  # sliding and full layers alternate
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, True),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_other_architectures_split_to_the_whole_export_s_graph(name: str, exported_layers: list[int]) -> None:
    import transformers

    config_class, model_class, settings, alike = ARCHITECTURES[name]
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name != "gpt_neox":
        sizes["num_key_value_heads"] = 2
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes, **settings)).eval()
    at = ["gpt_neox.layers.2" if name == "gpt_neox" else "model.layers.2"]
    repeated, whole = split(model, at), split(model, at, repeat=False)
    assert exported_layers == [2 if alike else 4, 4]
    assert graphs(repeated) == graphs(whole)
    ids, mask, _ = lm_batch(4, 8, seed=1)
    torch.testing.assert_close(repeated(ids, mask), model(ids, attention_mask=mask).logits, rtol=0, atol=0)
