"""Module-level recompute: pipe.recompute.recompute(module)."""
from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from recompute_models import assert_same_as_plain, blocks, kept_bytes, sample
from torch import nn

import pipe
from pipe.recompute import FullRecompute, policy_of, recompute, select_recompute, unmark


def test_full_recompute_keeps_outputs_and_gradients() -> None:
    assert_same_as_plain(blocks(), lambda m: [recompute(b) for b in m], sample())


def test_dropout_masks_are_replayed() -> None:
    assert_same_as_plain(blocks(dropout=0.5), lambda m: [recompute(b) for b in m], sample())


def test_marking_a_submodule_inside_a_block() -> None:
    assert_same_as_plain(blocks(), lambda m: [recompute(b.mlp) for b in m], sample())


def test_memory_drops_to_the_layer_inputs() -> None:
    plain, x = blocks(), sample()
    marked = copy.deepcopy(plain)
    for b in marked:
        recompute(b)
    # Only the inputs of blocks 1..3 (block 0's input is the caller's) are kept.
    assert kept_bytes(marked, x) == 3 * x.numel() * x.element_size()
    assert kept_bytes(plain, x) > 10 * kept_bytes(marked, x)


def test_nested_marks_recompute_once() -> None:
    model = blocks(n=1)
    calls = []
    model[0].mlp.register_forward_pre_hook(lambda *_: calls.append(pipe.is_recomputing()))
    recompute(model[0])
    recompute(model[0].mlp)  # inside the outer region: ignored, not recomputed twice
    model(sample()).sum().backward()
    assert calls == [False, True]


def test_is_recomputing_inside_the_recomputation() -> None:
    model = blocks(n=1)
    seen = []
    model[0].attn.register_forward_pre_hook(lambda *_: seen.append(pipe.is_recomputing()))
    recompute(model[0])
    model(sample()).sum().backward()
    assert seen == [False, True]


def test_no_grad_and_unmark_run_plainly() -> None:
    model = blocks(n=1)
    recompute(model[0])
    with torch.no_grad():
        assert model(sample()).grad_fn is None
    assert isinstance(policy_of(model[0]), FullRecompute)
    unmark(model[0])
    assert policy_of(model[0]) is None and "forward" not in model[0].__dict__
    recompute(model[0], enabled=False)
    assert policy_of(model[0]) is None


def test_names_state_dict_and_copies_are_unchanged() -> None:
    plain = blocks(n=2)
    marked = copy.deepcopy(plain)
    recompute(marked[1])
    assert marked.state_dict().keys() == plain.state_dict().keys()
    assert [n for n, _ in marked.named_modules()] == [n for n, _ in plain.named_modules()]
    for clone in (copy.deepcopy(marked), pickle.loads(pickle.dumps(marked))):
        assert isinstance(policy_of(clone[1]), FullRecompute)
        assert clone[1].forward._module() is clone[1]  # the copy runs its own parameters
        assert_same_as_plain(plain, lambda m: m.load_state_dict(clone.state_dict()), sample(), steps=1)


def test_a_marked_model_is_freed_without_the_garbage_collector() -> None:
    """A mark makes no reference cycle: a deleted model's memory (GPU memory too) goes at once, not at the
    next collection (a marked forward holding its module kept each planner run's model until one)."""
    def trained() -> nn.Module:
        model = blocks(n=2)
        select_recompute(model[0], ops=["gelu"])
        recompute(model[1])
        model(sample()).sum().backward()
        return model

    trained()  # the first call's imports leave cycles of their own
    gc.collect()
    model = trained()
    weight = weakref.ref(next(model.parameters()))
    gc.disable()
    try:
        del model
        assert weight() is None
    finally:
        gc.enable()


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="expected an nn.Module"):
        recompute(torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled must be True or False"):
        recompute(nn.Linear(1, 1), enabled="yes")  # type: ignore[arg-type]


class _FailsOnce(nn.Linear):
    failed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a forward that fails once")
        return super().forward(x)


@pytest.mark.parametrize("selective", [False, True])
def test_a_marked_forward_that_raises_leaves_no_hooks_behind(selective: bool) -> None:
    # torch 2.11 left the failed checkpoint's saved-tensor hooks on the thread: the next forward packed
    # into it, and its backward replayed the failed layer.
    layer = _FailsOnce(4, 4)
    if selective:
        select_recompute(layer, ops=["addmm"])
    else:
        recompute(layer)
    other = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="a forward that fails once") as failure:
        layer(x)
    # The error is still held (as a log record, a notebook's last traceback or this test hold it).
    assert failure.value.__traceback__ is not None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    other(x).square().sum().backward()
    layer(x).sum().backward()  # the layer works once it no longer fails
    assert other.weight.grad is not None and layer.weight.grad is not None
