"""Checkpoints of HuggingFace GPT-2 and LLaMA cut by pipe.split, through every layout on 4 gloo ranks, bit for bit.

One uninterrupted run at (pp 2, dp_shard 2) is the reference. A chain of
other layouts each loads the checkpoint the previous one saved, runs one
step and saves: (pp 4), (pp 2, dp_replicate 2), ZeRO-2 at (pp 2, dp_shard 2),
HSDP (pp 1, dp_replicate 2, dp_shard 2) and (pp 1, dp_shard 4). Each step's
loss and every gradient (gathered whole) equal the reference run's step to
the last bit, so each layout saved and loaded the model and AdamW's state
exactly. The last checkpoint loads into ``pipe.Pipe`` (one process) and into
the plain HuggingFace model, whose weights then equal the reference's.

Bitwise across layouts, as in test_state_resharding.py: every data-parallel
rank takes the same batch (averaging equal gradients is exact), and a tied
model runs one micro-batch (its weight's gradient is the embedding's plus the
head's in every layout; over several micro-batches the sums would associate
differently when the two uses share a rank).

A tied split model at pipeline size 1 holds the embedding and the LM head in
two pieces of one stage: ``Shard(unit="stage")`` (one FSDP group per piece) is
refused naming the weight by its plain name; ``Shard(blocks=lambda name, module: False)``
shards the stage as one group.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import pipe
from pipe.distributed import DistributedPipe, Shard, make_mesh, state
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import gpt2, lm_batch, lm_loss, llama, predicted_tokens  # noqa: E402

pytest.importorskip("transformers")

LAYERS = 4  # 4 pieces: one per stage at (pp 4)


def _llama_untied() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                                        eos_token_id=0))


MODELS: dict[str, tuple[Callable[[], nn.Module], str, bool]] = {
    "gpt2": (lambda: gpt2(layers=LAYERS), "transformer.h", True),
    "llama": (lambda: llama(layers=LAYERS), "model.layers", True),
    "llama-untied": (_llama_untied, "model.layers", False),
}
EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}

# (label, mesh sizes, the Shard's arguments): the reference first, then the chain.
ZERO3: dict[str, Any] = {"reshard_after_forward": True}  # a layer at a time (the default unit, "block")
LAYOUTS: list[tuple[str, dict[str, int], dict[str, Any] | None]] = [
    ("pp 2, dp_shard 2", dict(pp=2, dp_shard=2), {**ZERO3, "unit": "stage"}),
    ("pp 4", dict(pp=4), None),
    ("pp 2, dp_replicate 2", dict(pp=2, dp_replicate=2), None),
    ("pp 2, dp_shard 2, ZeRO-2", dict(pp=2, dp_shard=2), {"reshard_after_forward": False}),
    ("pp 2, dp_shard 2, gathered by layer", dict(pp=2, dp_shard=2), {"unit": "block"}),
    ("HSDP pp 1, dp_replicate 2, dp_shard 2", dict(pp=1, dp_replicate=2, dp_shard=2), ZERO3),
    ("pp 1, dp_shard 4", dict(pp=1, dp_shard=4), ZERO3),
    ("pp 1, dp_shard 4, ZeRO-2", dict(pp=1, dp_shard=4), {"reshard_after_forward": False}),  # the pieces as groups
]


_CAPTURED: dict[str, nn.Module] = {}  # split in the test's process: forked ranks copy it instead of capturing


def _split(which: str, seed: int) -> tuple[nn.Module, nn.Module]:
    build, blocks, _ = MODELS[which]
    torch.manual_seed(seed)
    model = build()
    ids, mask, _ = lm_batch(4, 8)
    cuts = [f"{blocks}.{k}" for k in range(1, LAYERS)]
    return model, pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=cuts)


def _stages(which: str, other: bool = False) -> nn.Module:
    """The split model of seed 0 (a copy of the test process's capture, where the ranks were forked), or with
    ``other`` weights, which a load must replace."""
    stages = copy.deepcopy(_CAPTURED[which]) if which in _CAPTURED else _split(which, 0)[1]
    if other:
        with torch.no_grad():
            for tensor in stages.state_dict().values():
                tensor.add_(1.0)
    return stages


def _build(stages: nn.Module, which: str, sizes: dict[str, int], arguments: dict[str, Any] | None
           ) -> tuple[DistributedPipe, Any]:
    tied = MODELS[which][2]
    shard = None if arguments is None else Shard(**arguments)  # default blocks: a tied head stays in its stage's group
    piped = DistributedPipe(stages, chunks=1 if tied else 2, schedule="1f1b", mesh=make_mesh(**sizes),
                            shard=shard, loss_reduction="sum")
    return piped, torch.optim.AdamW(piped.parameters(), lr=0.01)


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _step(piped: DistributedPipe, optimizer: Any, step: int) -> tuple[float, dict[str, list[float]]]:
    """One step on the same batch on every rank: the loss and this rank's gradients, gathered whole."""
    ids, mask, labels = lm_batch(4, 8, seed=step)
    tokens = predicted_tokens(labels)
    loss = piped.step((ids, mask), labels, lambda logits, y: lm_loss(logits, y, tokens), broadcast_loss=True)
    assert loss is not None
    grads = {name: _full(p.grad).flatten().tolist() for name, p in piped.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), grads


def _weights(piped: DistributedPipe) -> dict[str, list[float]]:
    return {name: _full(p.detach()).flatten().tolist() for name, p in piped.named_parameters()}


def _chain(rank: int, world: int, which: str, folder: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    label, sizes, arguments = LAYOUTS[0]
    reference, optimizer = _build(_stages(which), which, sizes, arguments)
    steps = [_step(reference, optimizer, 0)]
    state.save(f"{folder}/after1", reference, optimizer, step=1)
    steps += [_step(reference, optimizer, k) for k in range(1, len(LAYOUTS))]
    results["reference"] = (steps, _weights(reference))
    if MODELS[which][2]:  # tied, pipeline size 1: blocks chosen so that two groups hold the weight are refused
        pieces = Shard(unit="stage", blocks=lambda name, module: name in ("0", "3"))  # the first and last pieces
        with pytest.raises(ValueError) as refused:
            DistributedPipe(_stages(which), mesh=make_mesh(pp=1, dp_shard=4), shard=pieces)
        results["refusal"] = str(refused.value)
        # The head a block (the graph the split outlined for it); the first piece's holder of the embedding, also
        # named lm_head, left to the stage.
        head = Shard(blocks=lambda name, module: name == "lm_head" and isinstance(module, torch.fx.GraphModule))
        with pytest.raises(ValueError) as refused:
            DistributedPipe(_stages(which), mesh=make_mesh(pp=1, dp_shard=4), shard=head)
        results["head refusal"] = str(refused.value)
        with pytest.raises(ValueError) as refused:  # ZB-V puts the first and the last stage on rank 0
            DistributedPipe(_stages(which), chunks=2, schedule="zbv", mesh=make_mesh(pp=2, dp_shard=2))
        results["zbv refusal"] = str(refused.value)
    for k, (label, sizes, arguments) in enumerate(LAYOUTS[1:], start=1):
        piped, optimizer = _build(_stages(which, other=True), which, sizes, arguments)
        if arguments == {"unit": "block"}:  # each decoder layer is an FSDP unit of its own, gathered by its hooks
            sharding = piped._runtime.sharding
            results["by block"] = {s: len(blocks) for s, blocks in sharding.by_block.items()}
        assert state.load(f"{folder}/after{k}", piped, optimizer) == {"step": k}
        results[label] = _step(piped, optimizer, k)
        state.save(f"{folder}/after{k + 1}", piped, optimizer, step=k + 1)
        if k == len(LAYOUTS) - 1:
            results["last weights"] = _weights(piped)
    return results


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("which", sorted(MODELS))
def test_split_model_checkpoint_through_every_layout(which: str, tmp_path: Path) -> None:
    _CAPTURED[which] = _split(which, 0)[1]
    try:
        per_rank = run_ranks(_chain, 4, which, str(tmp_path), deadline=240, timeout=60)
        stages = _stages(which, other=True)  # for Pipe, below
    finally:
        del _CAPTURED[which]
    steps = per_rank[0]["reference"][0]
    reference_grads: list[dict[str, list[float]]] = [{} for _ in steps]
    reference_weights: dict[str, list[float]] = {}
    for result in per_rank:
        for k, (_, grads) in enumerate(result["reference"][0]):
            reference_grads[k].update(grads)
        reference_weights.update(result["reference"][1])
    torch.manual_seed(1)
    plain = MODELS[which][0]()
    names = [name for name, _ in plain.named_parameters()]
    assert sorted(reference_grads[0]) == sorted(names)  # every parameter, under the plain model's name
    for k, (label, _, _) in enumerate(LAYOUTS[1:], start=1):
        for rank, result in enumerate(per_rank):
            loss, grads = result[label]
            assert loss == steps[k][0], (label, rank, loss, steps[k][0])  # to the last bit
            assert grads, (label, rank)
            for name, values in grads.items():
                assert values == reference_grads[k][name], f"{label}, rank {rank}: the gradient of {name} differs"
    # Gathered by layer: every decoder layer an FSDP unit of its own on the ranks that hold it (two replicas), and
    # so are the modules with weights of their own (final norm, head, GPT-2's position embedding, an untied
    # embedding; a tied one stays in its stage's group).
    own = {"gpt2": 3, "llama": 2, "llama-untied": 3}[which]
    assert sum(count for result in per_rank for count in result["by block"].values()) == 2 * (LAYERS + own)
    last: dict[str, list[float]] = {}
    for result in per_rank:
        last.update(result["last weights"])
    assert last == reference_weights  # every layout saved and loaded in turn: the reference's weights
    embedding = EMBEDDING[which.split("-")[0]]
    if MODELS[which][2]:  # refused by the plain model's name of the tied weight, with the fix
        refusal = per_rank[0]["refusal"]
        assert f"parameter {embedding!r} is held by two blocks of stage 0, '0' and '3'" in refusal
        assert "Shard(blocks=lambda name, module: False)" in refusal
        assert per_rank[0]["head refusal"].startswith(
            f"parameter {embedding!r} of block 'lm_head' of stage 0 is also held outside the stage's blocks")
        assert "leave 'lm_head' out of Shard(blocks=...)" in per_rank[0]["head refusal"]
        assert per_rank[0]["zbv refusal"].startswith(f"the tied weight {embedding!r} of stages [0, 3] on pipeline "
                                                     "rank 0 is held by two stages of one rank")
    # The checkpoint's keys are the plain model's, a tied weight once (under its named_parameters() name).
    metadata = dcp.FileSystemReader(str(tmp_path / "after1")).read_metadata().state_dict_metadata
    saved = {key.split(".", 1)[1] for key in metadata if key.startswith("model.")}
    assert saved == {name for name, _ in plain.named_parameters()} | {
        name for name, _ in plain.named_buffers() if name in plain.state_dict()}
    assert ("lm_head.weight" in saved) != MODELS[which][2] and embedding in saved
    assert f"optimizer.state.{embedding}.exp_avg" in metadata
    # The last checkpoint, saved at (pp 1, dp_shard 4), in this process: into the plain model and into Pipe.
    final = tmp_path / f"after{len(LAYOUTS)}"
    assert state.load_module(final, plain) == {"step": len(LAYOUTS)}
    for name, parameter in plain.named_parameters():
        assert parameter.detach().flatten().tolist() == reference_weights[name], name
    piped = pipe.Pipe(stages, chunks=2, balance=[2, 2], devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(piped.parameters(), lr=0.01)
    assert state.load(final, piped, optimizer) == {"step": len(LAYOUTS)}
    for name, value in piped.state_dict().items():  # the plain model's keys (a tied weight under both)
        assert name not in reference_weights or value.flatten().tolist() == reference_weights[name], name
    # Pipe saves what the plain model loads, AdamW's state included: one more step of each is the same.
    state.save(tmp_path / "pipe", piped, optimizer, step=0)
    reloaded = copy.deepcopy(plain)
    reloaded_optimizer = torch.optim.AdamW(reloaded.parameters(), lr=0.01)
    state.load_module(tmp_path / "pipe", reloaded, reloaded_optimizer)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    state.load_module(final, plain, plain_optimizer)
    ids, mask, labels = lm_batch(4, 8, seed=99)
    for module, opt in ((reloaded, reloaded_optimizer), (plain, plain_optimizer)):
        lm_loss(module(ids, attention_mask=mask).logits, labels).backward()
        opt.step()
    for (name, a), b in zip(plain.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), name
