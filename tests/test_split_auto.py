"""``pipe.split(..., at="auto", stages=N)``: the cut weighs each layer, the embedding and the head by FLOPs;
``at="layers"``: a piece per layer, the embedding and the head apart, for the planner to group by measured cost."""
from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

import pipe
from pipe.balance.flops import layer_flops
from pipe.balance.solver import solve

transformers = pytest.importorskip("transformers")


def _llama(vocab: int, layers: int = 8, device: str = "cpu") -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def test_the_head_s_flops_go_to_the_last_layer_and_the_layers_cost_alike() -> None:
    model = _llama(vocab=8000, device="meta")  # costed on fake tensors: a meta model is fine
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")  # beside a meta model (torch 2.11 refuses the CPU)
    layers = [f"model.layers.{k}" for k in range(8)]
    costs = layer_flops(model, (ids,), {"use_cache": False}, layers)
    assert len(set(costs[1:-1])) == 1 and costs[1] > 0, costs  # alike layers, alike FLOPs
    assert costs[0] == costs[1]  # an embedding is a lookup: no FLOPs before the first layer
    tokens, hidden, vocab = 2 * 32, 64, 8000
    assert costs[-1] - costs[1] == 2 * tokens * hidden * vocab  # the head's matmul, on the last layer


def test_auto_cut_balances_the_stages_by_flops_and_equals_the_plain_model(caplog: pytest.LogCaptureFixture) -> None:
    model = _llama(vocab=8000)
    ids = torch.randint(0, 8000, (2, 32), generator=torch.Generator().manual_seed(1))
    layers = [f"model.layers.{k}" for k in range(8)]
    costs = layer_flops(model, (ids,), {"use_cache": False}, layers)
    with caplog.at_level(logging.INFO, logger="pipe.balance.flops"):
        stages = pipe.split(model, (ids,), {"use_cache": False}, at="auto", stages=4)
    assert len(stages) == 4
    balance = solve(costs, 4)
    assert balance[-1] < balance[0]  # the head weighs like several layers: the last stage gets fewer
    cut = [layers[sum(balance[:k])] for k in range(1, 4)]
    assert f"cut before {cut}" in caplog.text, caplog.text
    even = max(sum(costs[k:k + 2]) for k in range(0, 8, 2))
    chosen = max(sum(costs[sum(balance[:k]):sum(balance[:k + 1])]) for k in range(4))
    assert chosen < even  # the costliest stage is cheaper than with 2 layers each
    with torch.no_grad():
        torch.testing.assert_close(stages(ids), model(ids, use_cache=False).logits)


@pytest.mark.parametrize("at, stages, message", [
    ("auto", None, r"at='auto'\) needs stages=N, an int >= 2"),
    ("auto", 1, r"needs stages=N, an int >= 2 .*got stages=1"),
    ("auto", 9, r"the model has 8 layers to cut between .*give stages <= 8"),
    (["model.layers.4"], 2, r"stages=2 goes with at='auto'"),
    ("layers", 4, r"at='layers'\) cuts before every layer, so it takes no stages= \(got stages=4\); leave it out"),
])
def test_bad_auto_cuts_are_refused_naming_the_fix(at: object, stages: object, message: str) -> None:
    model = _llama(vocab=64, device="meta")
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        pipe.split(model, (ids,), {"use_cache": False}, at=at, stages=stages)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a list of module paths such as .*'auto' with stages=N, or 'layers', got 'everywhere'"):
        pipe.split(model, (ids,), {"use_cache": False}, at="everywhere", stages=2)


def test_cut_at_every_layer_the_embedding_and_the_head_are_pieces_of_their_own() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from split_models import assert_same_lm_step, gpt2, lm_batch

    model = _llama(vocab=512, layers=3)
    reference = copy.deepcopy(model)
    ids, mask, labels = lm_batch(4, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at="layers")
    assert [sorted(dict(piece.named_parameters())) for piece in stages] == [
        ["model.embed_tokens.weight"],
        *[sorted(k for k in dict(model.named_parameters()) if k.startswith(f"model.layers.{i}.")) for i in range(3)],
        ["lm_head.weight", "model.norm.weight"]]
    assert_same_lm_step(stages, model, reference, ids, mask, labels)

    model = gpt2(layers=2)  # the final norm is ln_f; the position embedding stays with the token embedding
    reference = copy.deepcopy(model)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at="layers")
    layers = [{name.split(".")[2] for name, _ in piece.named_parameters() if ".h." in name} for piece in stages]
    assert len(stages) == 4 and layers == [set(), {"0"}, {"1"}, set()], layers
    assert "transformer.wpe.weight" in dict(stages[0].named_parameters())
    assert {"transformer.ln_f.weight", "transformer.ln_f.bias"} <= set(dict(stages[3].named_parameters()))
    assert_same_lm_step(stages, model, reference, ids, mask, labels)


def test_the_planner_groups_the_pieces_of_a_model_cut_at_every_layer() -> None:
    """The plan's balance counts pieces: the embedding, each layer, the norm with the head; built from it, the
    pipeline equals the plain model."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pipe.plan
    from split_models import lm_batch, lm_loss

    model = _llama(vocab=512, layers=4)
    ids, mask, labels = lm_batch(4, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at="layers")
    plan = pipe.plan.plan(stages, (ids, mask), memory_budget="1GiB", stages=2, chunks=(1, 2), rounds=1,
                          link=None, loss_fn=lm_loss, target=labels)
    assert len(plan.candidate.balance) == 2 and sum(plan.candidate.balance) == 6, plan.candidate
    piped = pipe.Pipe(stages, **plan.pipe_kwargs())
    with torch.no_grad():
        torch.testing.assert_close(piped(ids, mask), model(ids, attention_mask=mask, use_cache=False).logits)
