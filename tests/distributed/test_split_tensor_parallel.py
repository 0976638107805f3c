"""Tensor parallelism inside the graphs of ``pipe.split`` stages of HuggingFace models, against the plain model.

Each case cuts the model with ``pipe.split``, gives ``DistributedPipe`` the
standard plan (``hf.tensor_parallel_plan``: q, k, v, gate, up split by
columns; o, down by rows) and runs 3 AdamW steps on the global batch split
over the data-parallel ranks, comparing the loss and every gradient with the
plain model's (1e-5), the weights after (1e-4) and a held-out ``eval_step``;
then exports with ``hf.save`` and checkpoints with ``state.save``, and loads
both into pipelines of another layout.
"""
from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

import pipe.distributed as pd
from pipe.distributed.local_pieces import pieces
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _full(tensor: Tensor) -> Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    if any(isinstance(p, _StridedShard) for p in tensor.placements):  # torch 2.11's full_tensor refuses them
        return _assembled(tensor)
    if tensor.device.type == "cuda" and tensor.device_mesh.ndim == 1:  # gloo's all-gather of CUDA tensors crashed
        (placement,) = tensor.placements  # (torch 2.11, one H200): gather through the host
        local = tensor.to_local().detach().cpu()
        if placement.is_replicate():
            return local.to(tensor.device)
        pieces = [torch.empty_like(local) for _ in range(tensor.device_mesh.size())]
        torch.distributed.all_gather(pieces, local.contiguous(), group=tensor.device_mesh.get_group())
        return torch.cat(pieces, dim=placement.dim).to(tensor.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensor's note that a 2-D gather takes two all-gathers
        return tensor.full_tensor()


def _assembled(tensor: DTensor) -> Tensor:
    """The whole of ``tensor`` from every rank's blocks (``local_pieces.pieces``, as the checkpoints write them),
    gathered one mesh dimension at a time: GPT-2's fused q/k/v under tensor parallelism is a ``_StridedShard``,
    which torch 2.11's ``full_tensor`` cannot redistribute ('unable to be interpreted into a shard_order')."""
    blocks = [(piece.detach().cpu(), offset) for piece, offset in pieces(tensor)]
    for dim in range(tensor.device_mesh.ndim):
        gathered: list[Any] = [None] * tensor.device_mesh.size(dim)
        torch.distributed.all_gather_object(gathered, blocks, group=tensor.device_mesh.get_group(dim))
        blocks = [block for part in gathered for block in part]
    whole = torch.full(tensor.shape, float("nan"), dtype=tensor.dtype)
    for piece, offset in blocks:
        whole[tuple(slice(start, start + size) for start, size in zip(offset, piece.shape))] = piece
    assert not whole.isnan().any(), "the blocks do not cover the tensor"
    return whole.to(tensor.device)


def _sum_count(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    shifted, target = logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shifted, target, ignore_index=-100, reduction="sum"), \
        (target != -100).sum()


def _model(kind: str) -> nn.Module:
    from split_models import gpt2, llama

    if kind == "gpt2":  # q, k and v in one Conv1D (addmm), split into three: each rank takes its heads of each
        return gpt2(layers=4)

    if kind == "qwen2":  # q, k and v with biases, an untied head
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                            max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    if kind == "qwen3":  # q_norm and k_norm: whole weights applied to each rank's heads
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                            max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    if kind == "olmo2":  # q and k normed over all heads: q, k, v gathered, o's whole input sliced
        from transformers import Olmo2Config, Olmo2ForCausalLM

        return Olmo2ForCausalLM(Olmo2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                            max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                                            eos_token_id=0))
    if kind == "phi3":  # qkv_proj and gate_up_proj fused and chunked: their outputs gathered, o and down sliced
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                          max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                                          eos_token_id=0))
    if kind == "qwen2moe":  # experts (and a shared one) after the attention: the plan splits the attention only
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        return Qwen2MoeForCausalLM(Qwen2MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                  max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                                  bos_token_id=0, eos_token_id=0))
    if kind == "gemma2":  # soft-capped logits and attention, sliding-window layers between global ones
        from transformers import Gemma2Config, Gemma2ForCausalLM

        return Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                              max_position_embeddings=64, sliding_window=4, pad_token_id=0,
                                              bos_token_id=0, eos_token_id=0))
    if kind == "granite":  # multipliers on the embedding, the attention, the residuals and the logits
        from transformers import GraniteConfig, GraniteForCausalLM

        return GraniteForCausalLM(GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                max_position_embeddings=64, embedding_multiplier=2.0,
                                                residual_multiplier=0.5, attention_multiplier=0.25,
                                                logits_scaling=4.0, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    model = llama(layers=4)
    if kind == "llama untied":
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _steps(piped: pd.DistributedPipe, reference: nn.Module, label: str,
           device: torch.device = torch.device("cpu"), gradients_until: int = 3) -> dict[str, float]:
    """3 AdamW steps against the plain model; each replica takes its rows of the 8-row global batch. Every gradient
    is compared in the first ``gradients_until`` steps (the later ones are taken at weights that AdamW's first
    steps have already moved apart by rounding, which some models amplify; the weights are compared at the end).

    GPT-2's AdamW takes ``eps=1e-6``: with the default 1e-8, an entry of its ``mlp.c_fc`` whose gradient is
    rounding noise (~1e-8) steps by up to ``lr`` in a direction that the noise sets (2e-4 apart after 3 steps,
    every gradient within 1e-5)."""
    from split_models import lm_batch

    eps = 1e-6 if label == "gpt2" else 1e-8
    # foreach=False: AdamW's multi-tensor path (CUDA's default) refuses a list mixing DTensors and plain tensors
    optimizer = torch.optim.AdamW(piped.parameters(), lr=0.01, eps=eps, foreach=False)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=eps)
    rows = 8 // piped.topology.data_parallel
    part = slice(piped.topology.replica * rows, piped.topology.replica * rows + rows)
    worst = {"loss": 0.0, "gradient": 0.0}
    for step in range(3):
        ids, mask, labels = (t.to(device) for t in lm_batch(8, 8, seed=step))
        loss = piped.step((ids[part], mask[part]), labels[part], _sum_count, broadcast_loss=True)
        total, counted = _sum_count(reference(ids, attention_mask=mask).logits, labels)
        (total / counted).backward()
        assert loss is not None
        torch.testing.assert_close(loss, (total / counted).detach(), atol=1e-5, rtol=1e-5)
        worst["loss"] = max(worst["loss"], float((loss - total / counted).abs()))
        for name, parameter in piped.named_parameters() if step < gradients_until else ():
            expected = reference.get_parameter(name).grad
            torch.testing.assert_close(_full(parameter.grad), expected, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{label}, step {step} {name}: {m}")
            worst["gradient"] = max(worst["gradient"], float((_full(parameter.grad) - expected).abs().max()))
        optimizer.step()
        expected_optimizer.step()
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
    for name, parameter in piped.named_parameters():
        torch.testing.assert_close(_full(parameter.detach()), reference.get_parameter(name).detach(), atol=1e-4,
                                   rtol=1e-4, msg=lambda m: f"{label}, {name} after 3 AdamW steps: {m}")
    return worst


def _held_out(piped: pd.DistributedPipe, reference: nn.Module) -> None:
    from split_models import lm_batch

    ids, mask, labels = lm_batch(8, 8, seed=7)
    rows = 8 // piped.topology.data_parallel
    part = slice(piped.topology.replica * rows, piped.topology.replica * rows + rows)
    loss = piped.eval_step((ids[part], mask[part]), labels[part], _sum_count, broadcast_loss=True)
    with torch.no_grad():
        total, counted = _sum_count(reference(ids, attention_mask=mask).logits, labels)
    torch.testing.assert_close(loss, total / counted, atol=1e-5, rtol=1e-5)


def _split(model: nn.Module, at: str = "layers.2", dynamic: bool = True) -> nn.Module:
    import pipe
    from split_models import lm_batch

    ids, mask, _ = lm_batch(8 if dynamic else 4, 8)  # static sizes: one micro-batch of _steps (8 rows, 2 chunks)
    at = f"transformer.h.{at.split('.')[-1]}" if model.config.model_type == "gpt2" else f"model.{at}"
    return pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=[at], dynamic=dynamic)


def _on_meta(kind: str) -> nn.Module:
    with torch.device("meta"):
        return _split(_model(kind))


def _exact_and_reloaded(rank: int, world: int, layout: dict[str, int], directory: str) -> dict[str, Any]:
    """Each model at ``layout``: exact steps; then its export and checkpoint loaded at another layout."""
    from transformers import AutoModelForCausalLM

    from pipe.distributed import hf, state

    other = {"pp": 2, "dp_shard": world // 2}
    found: dict[str, Any] = {}
    kinds = ("llama tied", "llama tied vocabulary", "llama untied", "qwen2", "qwen3", "gpt2") \
        if "dp_shard" not in layout else ("llama tied", "llama tied vocabulary", "llama untied", "gpt2")
    for kind in kinds:
        torch.manual_seed(0)
        model = _model(kind)
        reference = copy.deepcopy(model)
        # Both LLaMAs with their vocabulary split too (the embedding's rows, the head's output features; tied: one
        # weight, split alike on the first stage and the last), the tied one also without.
        plan = hf.tensor_parallel_plan(model, vocabulary=kind in ("llama untied", "llama tied vocabulary"))
        # With FSDP: each decoder layer gathered on its own and its gradients reduced after each backward.
        shard = pd.Shard(unit="block", reduce="micro-batch") if "dp_shard" in layout else None
        piped = pd.DistributedPipe(_split(model), chunks=2, schedule="1f1b", mesh=pd.make_mesh(**layout),
                                   loss_reduction="count", tensor_parallel=plan, shard=shard)
        split = sorted(name for name, p in piped.named_parameters() if isinstance(p, DTensor)
                       and "tp" in p.device_mesh.mesh_dim_names
                       and not p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_replicate())
        worst = _steps(piped, reference, kind)
        _held_out(piped, reference)
        # Out: a HF directory (each rank writes its slices) and a DCP checkpoint; in: another layout, built on meta.
        export, checkpoint = f"{directory}/{kind}-hf", f"{directory}/{kind}-dcp"
        hf.save(export, piped, config=reference.config)
        state.save(checkpoint, piped)
        exported = AutoModelForCausalLM.from_pretrained(export)
        for name, parameter in piped.named_parameters():  # the names this rank holds
            torch.testing.assert_close(exported.get_parameter(name), _full(parameter.detach()), atol=0, rtol=0,
                                       msg=f"{kind} export: {name}")
        for source, load in ((export, hf.load), (checkpoint, state.load)):
            for mesh in (layout, other):
                loaded = pd.DistributedPipe(_on_meta(kind), chunks=2, mesh=pd.make_mesh(**mesh),
                                            loss_reduction="count", init_weights=False,
                                            tensor_parallel=plan if "tp" in mesh else None)
                load(source, loaded)
                for name, parameter in loaded.named_parameters():
                    torch.testing.assert_close(_full(parameter.detach()), exported.get_parameter(name), atol=0,
                                               rtol=0, msg=f"{kind} {source} at {mesh}: {name}")
                _held_out(loaded, exported)
        if kind == "gpt2":  # and back: a checkpoint of whole weights (the last one loaded) into the strided layout
            state.save(f"{checkpoint}-other", loaded)
            strided = pd.DistributedPipe(_on_meta(kind), chunks=2, mesh=pd.make_mesh(**layout), loss_reduction="count",
                                         init_weights=False, tensor_parallel=plan)
            state.load(f"{checkpoint}-other", strided)
            for name, parameter in strided.named_parameters():
                torch.testing.assert_close(_full(parameter.detach()), exported.get_parameter(name), atol=0, rtol=0,
                                           msg=f"{kind} from {other} to {layout}: {name}")
        found[kind] = {"split": split, **worst}
    return found


@pytest.mark.timeout(960)
@pytest.mark.parametrize("layout", [{"pp": 2, "tp": 2}, {"pp": 2, "tp": 2, "dp_shard": 2}],
                         ids=["pp2-tp2", "pp2-tp2-dp_shard2"])
def test_split_hf_models_with_tensor_parallelism_match_the_plain_model(layout: dict[str, int]) -> None:
    """LLaMA (tied, with its vocabulary whole and split: embedding rows, head columns, one weight; untied and
    split), Qwen2 (q, k, v biases),
    Qwen3 (q and k norms over each head, their gradients summed over the tp ranks) and GPT-2 (q, k and v in one
    Conv1D: each rank holds its heads of each, a strided shard) at (pp 2, tp 2); the LLaMAs and GPT-2 at (pp 2, tp 2,
    dp_shard 2) on 8 ranks, FSDP gathering a layer at a time (Shard(unit="block", reduce="micro-batch")): loss and every gradient within 1e-5 of the plain model's, the weights after 3 AdamW
    steps within 1e-4, a held-out eval_step; hf.save's export equals the pipeline's weights in from_pretrained,
    and the export and a state.save checkpoint load bit for bit into pipelines built on meta at the same layout
    and at (pp 2, dp_shard) without tensor parallelism (GPT-2's checkpoint saved there loads back into the
    strided layout)."""
    pytest.importorskip("transformers")
    from split_models import llama

    llama()  # imports transformers' lazy modules once, here: the forked ranks inherit them
    world = 8 if "dp_shard" in layout else 4
    with tempfile.TemporaryDirectory() as directory:
        results = run_ranks(_exact_and_reloaded, world, layout, directory, deadline=900.0, timeout=60.0)
    names = [f"model.layers.{k}.{m}.weight" for k in range(4) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")]
    # GPT-2: the Conv1D weights, and the bias of c_fc; c_attn's bias stays whole (each rank adds its parts).
    gpt2_names = [f"transformer.h.{k}.{m}" for k in range(4) for m in
                  ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")]
    for kind, found in results[0].items():
        if kind == "gpt2":
            stages = [r[kind]["split"] for r in results]
            assert stages[0] == sorted(n for n in gpt2_names if n.startswith(("transformer.h.0.", "transformer.h.1.")))
            assert stages[-1] == sorted(n for n in gpt2_names if n.startswith(("transformer.h.2.", "transformer.h.3.")))
            assert found["gradient"] < 1e-5, (kind, found)
            continue
        # Each rank splits the layers of its stage: the first pipeline rank layers 0-1, the second 2-3.
        stages = [r[kind]["split"] for r in results]
        first = [n for n in names if n.startswith(("model.layers.0.", "model.layers.1."))]
        vocabulary = kind in ("llama untied", "llama tied vocabulary")
        assert stages[0] == sorted(first + (["model.embed_tokens.weight"] if vocabulary else []) + (["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
                                            "model.layers.0.self_attn.v_proj.bias", "model.layers.1.self_attn.q_proj.bias",
                                            "model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.v_proj.bias"]
                                           if kind == "qwen2" else [])), kind
        # The last stage's head: untied, its own weight; tied, the embedding's, named as the plain model names it.
        head = "model.embed_tokens.weight" if kind == "llama tied vocabulary" else "lm_head.weight"
        assert (head in stages[-1]) == vocabulary, kind
        assert all(n.startswith(("model.layers.2.", "model.layers.3.")) or n == head for n in stages[-1]), kind
        assert found["gradient"] < 1e-5, (kind, found)


def _static_sizes(rank: int, world: int) -> dict[str, float]:
    from pipe.distributed import hf

    worst: dict[str, float] = {}
    for kind in ("llama untied", "gpt2"):
        torch.manual_seed(0)
        model = _model(kind)
        reference = copy.deepcopy(model)
        piped = pd.DistributedPipe(_split(model, dynamic=False), chunks=2, schedule="1f1b",
                                   mesh=pd.make_mesh(pp=2, tp=2), loss_reduction="count",
                                   tensor_parallel=hf.tensor_parallel_plan(model, vocabulary=kind != "gpt2"))
        worst[kind] = _steps(piped, reference, kind)["gradient"]
        _held_out(piped, reference)
    return worst


@pytest.mark.timeout(300)
def test_split_hf_models_captured_at_static_sizes_take_tensor_parallelism_exactly() -> None:
    """pipe.split(..., dynamic=False) bakes the micro-batch's sizes into the graphs beside the heads' count; the
    tensor-parallel rewrite changes only the heads' (found by shape, not by value): LLaMA (its vocabulary split too)
    and GPT-2 at (pp 2, tp 2), 3 AdamW steps and a held-out eval_step against the plain model."""
    pytest.importorskip("transformers")
    from split_models import llama

    llama()
    for found in run_ranks(_static_sizes, 4, deadline=240.0, timeout=60.0):
        assert all(gradient < 1e-5 for gradient in found.values()), found


def _other_plans(rank: int, world: int) -> dict[str, list[str]]:
    from pipe.distributed import hf

    split: dict[str, list[str]] = {}
    for kind in ("olmo2", "phi3", "qwen2moe", "gemma2", "granite"):
        torch.manual_seed(0)
        model = _model(kind)
        reference = copy.deepcopy(model)
        piped = pd.DistributedPipe(_split(model), chunks=2, schedule="1f1b", mesh=pd.make_mesh(pp=2, tp=2),
                                   loss_reduction="count", tensor_parallel=hf.tensor_parallel_plan(model))
        split[kind] = sorted(name for name, p in piped.named_parameters()
                             if isinstance(p, DTensor) and not p.placements[0].is_replicate())
        # OLMo 2's gradients after AdamW's first step differ by up to 2e-5 where LLaMA's stay within 3e-6 (its
        # norms of q, k and each block's output amplify the rounding of the moved weights), and moved weights may
        # route a token of Qwen2-MoE to other experts: gradients compared at the first step.
        _steps(piped, reference, kind, gradients_until=1)
        _held_out(piped, reference)
    return split


@pytest.mark.timeout(300)
def test_the_plans_transformers_ships_for_other_families_split_their_stages_exactly() -> None:
    """OLMo 2 (its q and k normed over all heads) and Phi-3 (q, k, v in one fused qkv_proj, gate and up in one
    gate_up_proj, chunked): transformers' plans gather those outputs (colwise_gather_output) and slice o_proj's and
    down_proj's whole inputs (rowwise_split_input), so every rank runs the attention on all heads and holds half of
    each projection: every gradient of the first step and the loss of each of 3 AdamW steps within 1e-5 of the
    plain model's, the weights after them within 1e-4, a held-out eval_step; at (pp 2, tp 2). And Qwen2-MoE, whose
    config's plan also names a dense MLP it lacks: its attention splits, its experts stay whole; Gemma 2 and Granite
    with the plain column and row plans their configs ship."""
    pytest.importorskip("transformers")
    from split_models import llama

    llama()
    results = run_ranks(_other_plans, 4, deadline=280.0, timeout=60.0)
    olmo = [f"model.layers.{k}.{m}.weight" for k in range(4) for m in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")]
    phi = [f"model.layers.{k}.{m}.weight" for k in range(4) for m in
           ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    attention = [f"model.layers.{k}.self_attn.{m}.weight" for k in range(4) for m in ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj")]
    attention += [f"model.layers.{k}.self_attn.{m}.bias" for k in range(4) for m in ("q_proj", "k_proj", "v_proj")]
    for names, kind in ((olmo, "olmo2"), (phi, "phi3"), (attention, "qwen2moe"), (olmo, "gemma2"),
                        (olmo, "granite")):
        assert results[0][kind] == sorted(n for n in names if n.startswith(("model.layers.0.", "model.layers.1.")))
        assert results[-1][kind] == sorted(n for n in names if n.startswith(("model.layers.2.", "model.layers.3.")))


def _refusals(rank: int, world: int) -> dict[str, str]:  # and dropout over split values
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipe.distributed import hf
    from split_models import lm_batch, llama

    errors: dict[str, str] = {}

    def refused(label: str, model: nn.Module, plan: Any) -> None:
        try:
            pd.DistributedPipe(model, chunks=2, mesh=pd.make_mesh(pp=2, tp=2), tensor_parallel=plan)
            errors[label] = "no error"
        except ValueError as error:
            errors[label] = str(error)

    torch.manual_seed(0)
    model = llama(layers=4)
    plan = hf.tensor_parallel_plan(model)
    one_kv = llama(layers=4)
    one_kv.config.num_key_value_heads = 1  # the graph was captured for 2 KV heads; the config says what it has
    refused("kv heads", _split(one_kv), plan)
    refused("no module", _split(llama(layers=4)), {"model.layers.*.attn.qkv": ColwiseParallel()})
    refused("sequence parallel", _split(llama(layers=4)), {"model.layers.*.input_layernorm": SequenceParallel()})
    refused("norm over split features", _split(llama(layers=4)),
            {"model.layers.*.mlp.down_proj": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel()})
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64))
    ids, mask, _ = lm_batch(8, 8)
    import pipe

    stages = pipe.split(gpt2, (ids,), {"attention_mask": mask, "use_cache": False}, at=["transformer.h.1"])
    # c_attn split without c_proj: the heads' split values reach a whole Conv1D.
    refused("gpt2 c_attn alone", stages, {"transformer.h.*.attn.c_attn": ColwiseParallel()})
    # A tied weight split for the head only: the first stage's embedding would read it whole (across ranks: the
    # holders' layouts differ).
    refused("tied, head only", _split(llama(layers=4)),
            {**plan, "lm_head": ColwiseParallel(output_layouts=Replicate())})
    # GPT-2's config keeps dropout (0.1): attention dropout over each rank's heads draws masks of the rank's own,
    # the dropout of whole values (after c_proj's sum) the same masks on both ranks; and one step runs.
    from pipe.distributed.split_tensor_parallel import rank_random

    torch.manual_seed(0)
    dropped = pd.DistributedPipe(pipe.split(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                                                       n_positions=64)), (ids,),
                                            {"attention_mask": mask, "use_cache": False}, at=["transformer.h.1"]),
                                 chunks=2, mesh=pd.make_mesh(pp=2, tp=2), tensor_parallel=hf.tensor_parallel_plan(gpt2),
                                 loss_fn=lambda logits, target: logits.float().pow(2).mean())
    wrapped = [str(node.args[0]) for module in dropped.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes if node.target is rank_random]
    errors["wrapped dropout"] = ", ".join(wrapped)
    dropped.step((ids, mask), ids)
    planless = llama(layers=2)
    planless.config.base_model_tp_plan = None  # as a model type whose config ships none, and pipe has none
    try:
        hf.tensor_parallel_plan(planless)
        errors["no plan"] = "no error"
    except ValueError as error:
        errors["no plan"] = str(error)
    return errors


def _tied_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipe.distributed import hf

    torch.manual_seed(0)
    model = _model("llama tied")
    reference = copy.deepcopy(model)
    plan = hf.tensor_parallel_plan(model, vocabulary=True)
    piped = pd.DistributedPipe(_split(model), chunks=2, mesh=pd.make_mesh(pp=1, tp=2), loss_reduction="count",
                               tensor_parallel=plan)
    # Both pieces of the split on this rank, each holding the tied weight: one DTensor, registered in both.
    held = {id(p) for name, p in piped.named_parameters(remove_duplicate=False)
            if name.endswith(("embed_tokens.weight", "lm_head.weight"))}
    worst = _steps(piped, reference, "llama tied")
    _held_out(piped, reference)
    try:  # the head split, the embedding left whole: on one rank, refused by name
        pd.DistributedPipe(_split(_model("llama tied")), chunks=2, mesh=pd.make_mesh(pp=1, tp=2),
                           tensor_parallel={"lm_head": ColwiseParallel(output_layouts=Replicate())})
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    try:  # the embedding's rows split, the head's input features: one tensor cannot be split both ways
        pd.DistributedPipe(_split(_model("llama tied")), chunks=2, mesh=pd.make_mesh(pp=1, tp=2),
                           tensor_parallel={"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                            "lm_head": RowwiseParallel(input_layouts=Replicate())})
        crossed = "no error"
    except ValueError as error:
        crossed = str(error)
    return {"held": len(held), "refused": refused, "crossed": crossed, **worst}


@pytest.mark.timeout(200)
def test_a_tied_embedding_and_head_split_by_the_vocabulary_on_one_rank_match_the_plain_model() -> None:
    """(pp 1, tp 2): the tied LLaMA's two pieces on one rank, each holding the embedding's weight (read by the
    embedding in the first, by the head in the second), split by the vocabulary as one DTensor: 3 AdamW steps
    against the plain model. Splitting it for the head alone is refused (the embedding would read it whole), and
    so is splitting it by rows for one and by columns for the other."""
    pytest.importorskip("transformers")
    from split_models import llama

    llama()
    for found in run_ranks(_tied_on_one_rank, 2, deadline=180.0, timeout=60.0):
        assert found["held"] == 1, found
        assert found["gradient"] < 1e-5, found
        assert "is tied to a weight the plan splits elsewhere on this rank" in found["refused"] \
            or "reads the split weight" in found["refused"], found
        assert "vocabulary=True" in found["refused"], found
        assert "is tied to a weight already split as [Shard(dim=0)]" in found["crossed"], found
        assert "[Shard(dim=1)]" in found["crossed"], found


@pytest.mark.timeout(200)
def test_a_plan_that_split_graphs_cannot_compute_is_refused_at_once_on_every_rank() -> None:
    pytest.importorskip("transformers")
    from split_models import llama

    llama()
    results = run_ranks(_refusals, 4, deadline=180.0, timeout=60.0)
    for errors in results:
        assert "num_key_value_heads=1, which 2 does not divide" in errors["kv heads"]
        assert "matches no module of any stage" in errors["no module"]
        assert "SequenceParallel" in errors["sequence parallel"] and "ColwiseParallel()" in errors["sequence parallel"]
        # down_proj split by columns feeds the residual add and the next norm a split value: refused, op named.
        assert "cannot run on shards split 2 ways" in errors["norm over split features"], errors
        assert "cannot run on shards split 2 ways" in errors["gpt2 c_attn alone"], errors
        assert "addmm" in errors["gpt2 c_attn alone"] and "attn.c_proj)" in errors["gpt2 c_attn alone"], errors
        assert errors["wrapped dropout"] == "aten.scaled_dot_product_attention.default", errors  # one per layer
        assert "LlamaForCausalLM has no tensor-parallel plan" in errors["no plan"], errors
        assert "pipe has none for model_type 'llama'" in errors["no plan"], errors
        assert "laid out differently on the ranks that hold it" in errors["tied, head only"], errors


def _compiled(rank: int, world: int) -> dict[str, Any]:
    """The tied LLaMA at (pp 2, tp 2), compiled a layer at a time: tensor parallelism rewrites the layers' graphs
    after compile= has wrapped them, so each call must run the layer's current code."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from pipe.distributed import hf
    from pipe.split_blocks import blocks_of

    torch.manual_seed(0)
    model = _model("llama tied")
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    piped = pd.DistributedPipe(_split(model), chunks=2, schedule="1f1b", mesh=pd.make_mesh(pp=2, tp=2),
                               loss_reduction="count", tensor_parallel=hf.tensor_parallel_plan(model),
                               compile={"backend": counter})
    layers = [block for stage in piped.partitions.values() for block in blocks_of(stage) if ".layers." in block.path]
    worst = _steps(piped, reference, "compiled")
    return {"worst": worst, "compiled": piped.compiled_layers, "classes": len({type(b) for b in layers}),
            "frames": counter.frame_count}


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                    reason="compile= needs torch >= 2.13")  # refused below (pipe.compile.verify_compile says why)
@pytest.mark.timeout(300)
def test_split_layers_compiled_with_tensor_parallelism_match_the_plain_model() -> None:
    pytest.importorskip("transformers")
    from split_models import llama

    llama()
    results = run_ranks(_compiled, 4, deadline=280.0, timeout=60.0)
    for rank, found in enumerate(results):
        assert found["worst"]["gradient"] < 1e-5, found
        first = rank // 2 == 0  # the first pipeline rank's stage holds layers 0-1, the second's 2-3 and the head
        layers = ("model.layers.0", "model.layers.1") if first else ("model.layers.2", "model.layers.3")
        assert [name.partition(".")[2] for name in found["compiled"] if ".layers." in name] == list(layers), found
        assert found["classes"] == 1 and found["frames"] > 0, found  # the rewritten layers share one class


def test_a_dropout_over_split_values_draws_a_mask_of_its_ranks_own_and_replays_it() -> None:
    """``rank_random``: tensor parallelism wraps a dropout over each rank's heads so that ranks draw different
    masks, from a seed drawn alike on every rank (so a recomputation draws it again) plus the rank."""
    from pipe.distributed.split_tensor_parallel import rank_random

    x = torch.ones(64, 64)
    drop = torch.ops.aten.dropout.default

    def masks(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(7)
        dropped = rank_random(drop, rank, x, 0.5, True)
        return dropped == 0, torch.rand(4)  # the mask, and what the global stream gives next

    (first, after), (again, after_again), (other, after_other) = masks(0), masks(0), masks(1)
    assert torch.equal(first, again) and torch.equal(after, after_again)  # replayed alike
    assert not torch.equal(first, other)  # another rank, another mask
    assert torch.equal(after, after_other)  # the global stream moved alike on every rank: one draw
    torch.manual_seed(7)
    torch.randint(0, 2 ** 62, ())
    assert torch.equal(torch.rand(4), after)  # exactly one draw, the seed
    assert torch.equal(rank_random(drop, 0, x, 0.5, False), x)  # eval: no dropout


def _on_the_gpu(rank: int, world: int, device_type: str) -> dict[str, Any]:
    """(pp 2, tp 2) of the tied LLaMA with every rank's stage on the one GPU: gloo carries the CUDA tensors
    through host memory (NCCL takes one rank per device)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipe.distributed import hf

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    torch.manual_seed(0)
    model = _model("llama tied")
    reference = copy.deepcopy(model).to(device)
    mesh = init_device_mesh(device_type, (2, 2), mesh_dim_names=("pp", "tp"))  # make_mesh follows gloo: "cpu"
    piped = pd.DistributedPipe(_split(model), chunks=2, schedule="1f1b", mesh=mesh, loss_reduction="count",
                               tensor_parallel=hf.tensor_parallel_plan(model), device=device)
    placed = sorted({str(p.device) for p in piped.parameters()})
    split = sum(isinstance(p, DTensor) and not p.placements[-1].is_replicate() for p in piped.parameters())
    return {"devices": placed, "split": split, **_steps(piped, reference, "llama tied", device)}


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_split_llama_with_tensor_parallelism_on_the_gpu_matches_the_plain_model() -> None:
    """The (pp 2, tp 2) case with CUDA tensors: 4 ranks share the GPU; loss and every gradient within 1e-5 of the
    plain model's on the GPU, the weights after 3 AdamW steps within 1e-4."""
    pytest.importorskip("transformers")
    found = run_ranks(_on_the_gpu, 4, "cuda", timeout=120.0, deadline=280.0)
    for rank in found:
        assert rank["devices"] == ["cuda:0"] and rank["split"] > 0, rank


def test_a_configs_vocabulary_entry_is_left_to_the_vocabulary_choice() -> None:
    """transformers 5.17's LLaMA plan also splits ``embed_tokens`` (``embedding_rowwise``): the standard plan leaves
    it to ``vocabulary=`` (found on the GPU machine, whose transformers ships that entry) instead of refusing."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipe.distributed import hf

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **LlamaConfig.base_model_tp_plan}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = hf.tensor_parallel_plan(model)
    assert "model.embed_tokens" not in plan and "lm_head" not in plan
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    split = hf.tensor_parallel_plan(model, vocabulary=True)
    assert isinstance(split["model.embed_tokens"], RowwiseParallel) and isinstance(split["lm_head"], ColwiseParallel)


def test_a_configs_entries_for_modules_the_model_lacks_are_left_out() -> None:
    """Qwen2-MoE's config plan names a dense MLP (``layers.*.mlp.gate_proj``), which its sparse layers do not have:
    the standard plan keeps the entries the model has (its attention's) instead of a plan DistributedPipe refuses."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from pipe.distributed import hf

    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=32)
    assert "layers.*.mlp.gate_proj" in config.base_model_tp_plan
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    plan = hf.tensor_parallel_plan(model)
    assert sorted(plan) == [f"model.layers.*.self_attn.{m}" for m in ("k_proj", "o_proj", "q_proj", "v_proj")]
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
