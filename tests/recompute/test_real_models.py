"""Recompute policies on real layers: train-mode batch norm, GPT-2-style blocks, the memory of planning.

Each policy must leave outputs, gradients and running statistics equal to
the plain model's, say once and clearly when a selection chooses nothing,
and never hold more than the plain model while it plans (counted with
ActivationMemory).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from recompute_models import assert_same_as_plain, blocks, sample
from torch import Tensor, nn

from pipe.recompute import ActivationMemory, recompute, select_recompute, selective


def _bn_block(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 8), nn.BatchNorm1d(8),
                         nn.Tanh())


@pytest.mark.parametrize("policy", ["recompute", "select_gelu", "select_linear"])
def test_train_mode_batch_norm_equals_plain_and_updates_statistics_once(policy: str) -> None:
    plain = _bn_block()
    configure = {"recompute": lambda m: recompute(m),
                 "select_gelu": lambda m: select_recompute(m, ops=["gelu"]),
                 "select_linear": lambda m: select_recompute(m, names=["0", "3"])}[policy]
    x = torch.randn(6, 8)
    # Three steps each (plain and policy): the plan is made on the first, applied on the next.
    model = assert_same_as_plain(plain, configure, x, steps=3)
    for _ in range(2):  # the plain model had one step in assert_same_as_plain; bring it to three
        plain(x).sum().backward()
    for (name, expected), got in zip(plain.named_buffers(), model.buffers()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert model[1].num_batches_tracked.item() == plain[1].num_batches_tracked.item() == 3


class GPT2Attention(nn.Module):
    """GPT-2's attention as transformers' SDPA path runs it: softmax inside scaled_dot_product_attention."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(D, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(B, T, D))


class NewGELU(nn.Module):
    """transformers' gelu_new: the tanh approximation written as arithmetic."""

    def forward(self, x: Tensor) -> Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GPT2Block(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), GPT2Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), NewGELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _gpt2(layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[GPT2Block() for _ in range(layers)])


def test_gelu_and_softmax_choosing_nothing_on_gpt2_warn_once_each_with_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selective, "_warned", set())
    plain = _gpt2()
    x = sample(2, 5, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_as_plain(plain, lambda m: [select_recompute(b, ops=["gelu", "softmax"]) for b in m], x)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 2, messages  # one per op kind, not one per layer (3 layers)
    gelu, softmax = sorted(messages, key=lambda m: "op:softmax" in m)
    assert gelu.startswith("select_recompute 'op:gelu' chose no operation in any of its layers"), gelu
    assert "gelu_new" in gelu and "ops=['tanh']" in gelu and "The layer's operations are: " in gelu, gelu
    assert "tanh" in gelu.split("operations are: ")[1], gelu
    assert "softmax runs inside scaled_dot_product_attention" in softmax, softmax
    assert "pass ops=['scaled_dot_product_attention']" in softmax, softmax


def test_the_suggested_ops_choose_something_on_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selective, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a selection that chooses nothing would fail here
        assert_same_as_plain(_gpt2(), lambda m: [select_recompute(b, ops=["scaled_dot_product_attention", "tanh"])
                                                 for b in m], sample(2, 5, 16))


def _memory(model: nn.Module, x: Tensor) -> tuple[int, int]:
    """Bytes kept for backward after the forward (output excluded) and the forward's peak."""
    x = x.detach().requires_grad_()
    with ActivationMemory() as memory:
        y = model(x)
        kept, peak = memory.live_bytes - y.untyped_storage().nbytes(), memory.peak_bytes
        y.sum().backward()
    return kept, peak


@pytest.mark.parametrize("make", [lambda: blocks(2, d=32), _gpt2], ids=["softmax-blocks", "gpt2"])
def test_planning_a_new_shape_holds_no_more_than_the_plain_model(make: object) -> None:
    plain = make()  # type: ignore[operator]
    selected = copy.deepcopy(plain)
    for block in selected:
        select_recompute(block, ops=["softmax", "gelu", "scaled_dot_product_attention", "tanh"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one of the kinds is absent from each model
        for shape in [(4, 24), (4, 40)]:  # every new sequence length is planned anew
            x = sample(shape[0], shape[1], 32 if make is not _gpt2 else 16)
            kept, peak = _memory(plain, x)
            calls = [_memory(selected, x) for _ in range(4)]
            for call, (got_kept, got_peak) in enumerate(calls[:2]):  # planning: the plain forward, no more
                assert got_kept <= kept and got_peak <= peak, (shape, call, got_kept, kept, got_peak, peak)
            assert calls[3][0] < kept, (shape, calls, kept)  # planned: less than the plain model keeps
