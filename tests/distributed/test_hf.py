"""pipe.distributed.hf: HuggingFace directories into pipelines on 4 gloo ranks and back out, against the plain model.

GPT-2 (tied) and LLaMA (tied and untied) from tiny configs, saved with
``save_pretrained`` in sharded files (an index), are loaded into (pp 4) and
(pp 2, dp_shard 2) with each model's weights drawn from another seed first, so
that only the load can make them right. One training step then equals the
plain model that ``from_pretrained`` loaded (loss and every gradient), each
rank read only its own bytes, the export reloads with ``from_pretrained``
bit for bit and gives the pipeline's logits. Tensor parallelism (pp 2, tp 2;
column and row slices) on an ``nn.Sequential``; refusals and an interrupted
export in one process.
"""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import pipe
from pipe.distributed import DistributedPipe, hf, make_mesh
from pipe.distributed import safetensors_files
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import VOCAB, gpt2, lm_batch, llama  # noqa: E402

transformers = pytest.importorskip("transformers")

LAYERS = 4


def llama_untied(layers: int = LAYERS) -> nn.Module:
    model = llama(layers)
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    return type(model)(config)


MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "gpt2": (gpt2, "transformer.h.{}"), "llama": (llama, "model.layers.{}"), "llama_untied": (llama_untied, "model.layers.{}")}


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _sum_count(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    flat = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), flat, reduction="sum"), (flat != -100).sum()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each model saved by save_pretrained (seed 0) in files of 20 kB: an index and several shards."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for which, (build, _) in MODELS.items():
        torch.manual_seed(0)
        build(LAYERS).save_pretrained(root / which, max_shard_size="20KB")
        assert (root / which / safetensors_files.INDEX).is_file()
        made[which] = str(root / which)
    return made


def _split(which: str, pieces: int, meta: bool = False) -> tuple[nn.Module, Any]:
    build, cut = MODELS[which]
    torch.manual_seed(1)  # other weights than the checkpoint's: the load must replace every one
    with torch.device("meta" if meta else "cpu"):
        model = build(LAYERS)
    ids, mask, _ = lm_batch(8, 8)
    if meta:
        ids, mask = ids.to("meta"), mask.to("meta")
    at = [cut.format(LAYERS * (i + 1) // pieces) for i in range(pieces - 1)]
    return pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=at), model.config


def _round_trip(rank: int, world: int, checkpoints: dict[str, str], out: str, pp: int, dp_shard: int) -> dict[str, Any]:
    """Load each model, step against from_pretrained, export, reload: what each rank read, per model."""
    read: dict[str, Any] = {}
    for which, directory in checkpoints.items():
        stages, config = _split(which, pp)
        piped = DistributedPipe(stages, chunks=2, mesh=make_mesh(pp=pp, dp_shard=dp_shard), loss_reduction="count")
        hf.load(directory, piped)
        stats = hf.last_load()
        assert stats is not None and stats.bytes_read == stats.bytes_held > 0
        read[which] = {"bytes": stats.bytes_read, "keys": stats.keys}
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
        for name, tensor in piped.state_dict().items():  # every persistent tensor, bit for bit
            assert torch.equal(_full(tensor), reference.state_dict()[name]), f"{which} {name}"
        ids, mask, labels = lm_batch(8, 8, seed=3)
        part = slice(piped.topology.replica * 4, piped.topology.replica * 4 + 4) if dp_shard > 1 else slice(None)
        loss = piped.step((ids[part], mask[part]), labels[part], _sum_count, broadcast_loss=True)
        total, count = _sum_count(reference(ids, attention_mask=mask).logits, labels)
        (total / count).backward()
        torch.testing.assert_close(loss, (total / count).detach(), atol=1e-5, rtol=1e-5)
        for name, parameter in piped.named_parameters():
            torch.testing.assert_close(_full(parameter.grad), reference.get_parameter(name).grad, atol=1e-6,
                                       rtol=1e-5, msg=lambda m: f"{which} {name}: {m}")
        torch.optim.SGD(piped.parameters(), lr=0.5).step()  # the export holds trained weights, not the checkpoint's
        exported = os.path.join(out, which)
        hf.save(exported, piped, config=config, max_shard_size="24KB")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
        saved = safetensors_files.directory(exported)
        assert ("lm_head.weight" in saved) == (which == "llama_untied"), sorted(saved)  # a tie: stored once
        assert len({entry.file for entry in saved.values()}) > 1
        state = reloaded.state_dict()
        for name, tensor in piped.state_dict().items():
            assert torch.equal(_full(tensor), state[name]), f"export {which} {name}"
        _, outputs = piped.eval_step((ids[part], mask[part]), return_outputs=True)
        if piped.is_last:
            with torch.no_grad():
                torch.testing.assert_close(outputs, reloaded(ids[part], attention_mask=mask[part]).logits,
                                           atol=1e-5, rtol=1e-5)
    return read


def _totals(checkpoints: dict[str, str]) -> dict[str, int]:
    return {which: sum(e.dtype.itemsize * int(torch.Size(e.shape).numel())
                       for e in safetensors_files.directory(d).values()) for which, d in checkpoints.items()}


def test_pipeline_of_four_stages(checkpoints: dict[str, str], tmp_path: Path) -> None:
    read = run_ranks(_round_trip, 4, checkpoints, str(tmp_path), 4, 1, deadline=240)
    for which, total in _totals(checkpoints).items():
        # every tensor is read by the one rank that holds it, the tied embedding by the first and last
        embedding = VOCAB * 32 * 4 if which != "llama_untied" else 0
        assert sum(r[which]["bytes"] for r in read) == total + embedding, which
        assert all(r[which]["bytes"] < total / 2 for r in read), which


def test_pipeline_of_fsdp_shards(checkpoints: dict[str, str], tmp_path: Path) -> None:
    read = run_ranks(_round_trip, 4, checkpoints, str(tmp_path), 2, 2, deadline=240)
    for which, total in _totals(checkpoints).items():
        # each rank reads its half of each tensor of its stage (a tensor of one row is kept whole by one)
        embedding = VOCAB * 32 * 4 if which != "llama_untied" else 0
        assert sum(r[which]["bytes"] for r in read) == total + embedding, which
        assert all(r[which]["bytes"] < total / 3 for r in read), which
