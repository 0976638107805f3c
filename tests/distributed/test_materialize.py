"""Models built on meta: every tensor a rank allocates is initialised by known code, or construction refuses.

HuggingFace LLaMA and GPT-2 built under ``torch.device("meta")`` and cut by
``pipe.split``: each rank allocates its stages and initialises them with the
modules' ``reset_parameters()`` and the model's ``_init_weights`` (RMSNorm's
ones, the rotary ``inv_freq`` from the config). Random weights cannot equal a
CPU build's (the random numbers are drawn in another order, and only for the
rank's own layers), so the checks are: every tensor finite; every tensor
whose CPU-built value is not random (norms, biases, ``inv_freq``) equal to it;
random ones of the CPU build's spread; and after loading the CPU-built
model's checkpoint, one step equal to the plain model's to the last bit. A
layer nothing can initialise is refused, on every rank, by its plain name.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import pipe
from pipe.core.schedule import Schedule
from pipe.distributed import DistributedPipe, make_mesh, state
from pipe.distributed.stage import build_stages
from pipe.core.original_names import partition_name
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import gpt2, lm_batch, lm_loss, llama, predicted_tokens  # noqa: E402

MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "transformer.h.1"),
    "llama": (llama, "model.layers.1"),
}


class Gain(nn.Module):
    """A learned per-feature gain with no ``reset_parameters()``, and a table computed in ``__init__``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("table", torch.arange(width, dtype=torch.float32), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight + self.table


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.gain = Gain(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.gain(torch.tanh(self.body(x)))


_CAPTURED: dict[str, nn.Module] = {}  # captured in the test's process: forked ranks copy it instead of capturing


def _meta_split(which: str) -> nn.Module:
    if which in _CAPTURED:
        return copy.deepcopy(_CAPTURED[which])
    build, cut = MODELS[which]
    with torch.device("meta"):
        model = build()
    ids, mask, _ = (t.to("meta") for t in lm_batch(4, 8))  # on meta too (torch 2.11's export wants one device)
    return pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=[cut])


def _cpu(which: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[which][0]()


def _random(value: Tensor) -> bool:
    """Whether the CPU build drew ``value`` at random (not all one value, nor a buffer computed from the config)."""
    return value.is_floating_point() and value.numel() > 1 and bool(value.std() > 0) and value.requires_grad


def _plain(partition: nn.Module) -> list[tuple[str, Tensor]]:
    """A partition's parameters and buffers under the plain model's names."""
    return [(partition_name(partition, name), t)
            for name, t in list(partition.named_parameters()) + list(partition.named_buffers())]


def _verify_initialised(named: list[tuple[str, Tensor]], cpu: nn.Module, label: str) -> None:
    expected = dict(cpu.named_parameters()) | dict(cpu.named_buffers())
    for name, tensor in named:
        reference = expected[name]  # a plain name, also for buffers (model.rotary_emb.inv_freq)
        assert tensor.device.type == "cpu" and bool(torch.isfinite(tensor).all()), f"{label}: {name} is not finite"
        if _random(reference):  # the same distribution: a spread within 30% of the CPU build's
            ratio = float(tensor.detach().std() / reference.detach().std())
            assert 0.7 < ratio < 1.3, f"{label}: {name} has {ratio:.2f} times the CPU build's spread"
        else:
            assert torch.equal(tensor, reference), f"{label}: {name} differs from the CPU build's"


@pytest.mark.parametrize("which", sorted(MODELS))
def test_a_meta_split_model_is_initialised_by_the_models_own_code(which: str) -> None:
    # One rank with the whole model (both stages): a tied weight stays one tensor, every tensor is initialised.
    stages = _meta_split(which)
    again = copy.deepcopy(stages)  # (a copy of the capture costs less than another)
    schedule = Schedule("1f1b", ranks=1, microbatches=1)
    owned, skeleton = build_stages(stages, 2, [2], schedule, rank=0, device=torch.device("cpu"))
    cpu = _cpu(which)
    assert len(_plain(owned[0])) > 10
    _verify_initialised(_plain(owned[0]), cpu, which)
    embedding = owned[0][0].get_parameter("lm_head.weight")  # the name torch.export gave the tied weight
    assert embedding is owned[0][1].get_parameter("lm_head.weight")  # stage 0's embedding is stage 1's LM head
    for piece in owned[0]:  # a later stage's copy of a buffer (inv_freq) is set too: all equal the CPU build's
        _verify_initialised([(piece.original_names[n][0], b) for n, b in piece.named_buffers()], cpu, which)
    # On two ranks, rank 1 allocates only its stage; the embedding, held by stage 0, stays on meta there.
    schedule = Schedule("1f1b", ranks=2, microbatches=1)
    owned, skeleton = build_stages(again, 2, [1, 1], schedule, rank=1, device=torch.device("cpu"))
    _verify_initialised(_plain(owned[1]), cpu, which)
    assert all(p.is_meta for name, p in skeleton[0].named_parameters() if "layers.0" in name or "h.0" in name)


def test_a_layer_nothing_initialises_is_refused_by_its_plain_name() -> None:
    schedule = Schedule("1f1b", ranks=2, microbatches=1)
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), Gain(4))
    with pytest.raises(ValueError, match=r"the model was built on meta and nothing initialises '1.weight', "
                                         r"'1.table' once a rank allocates them.*reset_parameters\(\).*build the "
                                         r"model on the CPU"):
        build_stages(layers, 2, [1, 1], schedule, rank=1, device=torch.device("cpu"))
    # Rank 0 holds only the Linear: nothing to refuse there (DistributedPipe gathers every rank's names).
    build_stages(layers, 2, [1, 1], schedule, rank=0, device=torch.device("cpu"))
    with torch.device("meta"):
        model = Net()
    stages = pipe.split(model, (torch.randn(2, 4, device="meta"),), at=["gain"])
    with pytest.raises(ValueError, match=r"nothing initialises 'gain.weight', 'gain.table' once"):
        build_stages(stages, 2, [1, 1], schedule, rank=1, device=torch.device("cpu"))
    # A real value in a layer partly on meta is kept: only what was allocated is initialised.
    layer = nn.Linear(4, 4)
    with torch.device("meta"):
        layer.bias = nn.Parameter(torch.empty(4))
    weight = layer.weight.detach().clone()
    owned, _ = build_stages(nn.Sequential(layer), 1, [1], Schedule("1f1b", ranks=1, microbatches=1), rank=0,
                            device=torch.device("cpu"))
    assert torch.equal(owned[0][0].weight, weight) and bool(torch.isfinite(owned[0][0].bias).all())


def _meta_ranks(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(1)  # the same on every rank, as a script seeds (replicas then start equal)
    results: dict[str, Any] = {}
    for which in sorted(MODELS):
        piped = DistributedPipe(_meta_split(which), chunks=1, loss_reduction="sum")  # (pp 2)
        cpu = _cpu(which)
        _verify_initialised(list(piped.named_parameters()) + list(piped.named_buffers()), cpu, f"{which} rank {rank}")
        embedding = next(n for n, p in cpu.named_parameters() if p is cpu.get_input_embeddings().weight)
        results[f"{which} tied"] = dict(piped.named_parameters())[embedding].detach().flatten().tolist()
        results[f"{which} buffers"] = [name for name, _ in piped.named_buffers()]  # the plain model's names
        # The CPU build's checkpoint in: one step equals the plain model's, to the last bit.
        assert state.load(f"{folder}/{which}", piped) == {"built": "cpu"}
        ids, mask, labels = lm_batch(4, 8, seed=3)
        tokens = predicted_tokens(labels)
        loss = piped.step((ids, mask), labels, lambda logits, y: lm_loss(logits, y, tokens), broadcast_loss=True)
        expected = lm_loss(cpu(ids, attention_mask=mask).logits, labels)
        expected.backward()
        assert loss is not None and torch.equal(loss, expected.detach()), (which, loss, expected)
        for name, parameter in piped.named_parameters():
            assert torch.equal(parameter.grad, cpu.get_parameter(name).grad), f"{which}: the gradient of {name}"
    # Nothing initialises Gain's tensors: refused on both ranks, though only rank 1 holds them.
    with torch.device("meta"):
        model = Net()
    stages = pipe.split(model, (torch.randn(2, 4, device="meta"),), at=["gain"])
    with pytest.raises(ValueError, match=r"nothing initialises 'gain.weight', 'gain.table'"):
        DistributedPipe(stages, mesh=make_mesh(pp=2))
    return results


@pytest.mark.timeout(200)
def test_meta_split_models_train_from_known_values_on_two_ranks(tmp_path: Path) -> None:
    for which in MODELS:
        state.save(tmp_path / which, _cpu(which), built="cpu")
        _CAPTURED[which] = _meta_split(which)
    try:
        first, second = run_ranks(_meta_ranks, 2, str(tmp_path), deadline=180, timeout=60)
    finally:
        _CAPTURED.clear()
    for which in MODELS:
        assert first[f"{which} tied"] == second[f"{which} tied"]  # the embedding and the LM head start equal
    # The rotary embedding's buffer is the first stage's; the second holds its own copy where the split leaves the
    # rotary computation there too (torch 2.13's export does; 2.11's sends the cosines and sines across instead).
    assert first["llama buffers"] == ["model.rotary_emb.inv_freq"], first["llama buffers"]
    assert second["llama buffers"] in ([], ["model.rotary_emb.inv_freq"]), second["llama buffers"]
    assert first["gpt2 buffers"] == second["gpt2 buffers"] == []


@pytest.mark.cuda
def test_a_meta_split_model_is_initialised_on_a_gpu() -> None:
    # The allocation, the model's initialiser and the checks on the GPU (inv_freq is computed on the CPU and
    # copied in; the graph's device arguments follow the stage).
    stages = _meta_split("llama")
    device = torch.device("cuda", torch.cuda.current_device())
    owned, _ = build_stages(stages, 2, [2], Schedule("1f1b", ranks=1, microbatches=1), rank=0, device=device)
    cpu = _cpu("llama")
    named = _plain(owned[0])
    assert all(t.device == device for _, t in named)
    _verify_initialised([(name, t.cpu()) for name, t in named], cpu, "llama on cuda")
    ids, mask, _ = lm_batch(4, 8)
    assert bool(torch.isfinite(owned[0](ids.to(device), mask.to(device))).all())
