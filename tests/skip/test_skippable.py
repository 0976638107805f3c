"""@skippable, stash, pop and verify_skippables: declarations, errors, state-dict keys."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import Tensor, nn

from models import PopLinear, StashLinear, skip_model
from pipe import Pipe
from pipe.skip import Namespace, pop, skippable, stash, verify_skippables
from pipe.skip.skippable import Skippable


def test_decorated_class_keeps_name_keys_and_isinstance() -> None:
    layer = StashLinear(4)
    assert isinstance(layer, Skippable) and isinstance(layer, nn.Module)
    assert type(layer).__name__ == "StashLinear"
    assert list(layer.state_dict()) == ["linear.weight", "linear.bias"]  # no ".module." in between
    assert StashLinear.stashable_names == frozenset({"skip"})
    assert PopLinear.poppable_names == frozenset({"skip"})


def test_deepcopy_and_pickle_keep_namespaces() -> None:
    ns = Namespace()
    layer = StashLinear(4).isolate(ns)
    assert copy.deepcopy(layer).namespaced("skip") == (ns, "skip")
    assert pickle.loads(pickle.dumps(layer)).namespaced("skip") == (ns, "skip")


def test_verify_accepts_matched_model() -> None:
    verify_skippables(skip_model())


def test_verify_lists_every_problem() -> None:
    model = nn.Sequential(PopLinear(4), StashLinear(4), StashLinear(4))
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    message = str(info.value)
    assert "'0' pops 'skip' but no earlier layer stashes it" in message
    assert "'2' stashes 'skip' again after '1' without a namespace" in message
    assert "'1' stashes 'skip' but no later layer pops it" in message


def test_verify_duplicate_pop() -> None:
    model = nn.Sequential(StashLinear(4), PopLinear(4), PopLinear(4))
    with pytest.raises(TypeError, match="'2' pops 'skip' again without a namespace"):
        verify_skippables(model)


def test_verify_namespaces_separate_names() -> None:
    ns = Namespace()
    verify_skippables(nn.Sequential(StashLinear(4), StashLinear(4).isolate(ns), PopLinear(4).isolate(ns), PopLinear(4)))


def test_verify_sees_nested_layers() -> None:
    verify_skippables(nn.Sequential(nn.Sequential(nn.Linear(4, 4), StashLinear(4)), PopLinear(4)))
    with pytest.raises(TypeError, match="'0.1' stashes 'skip' but no later layer pops it"):
        verify_skippables(nn.Sequential(nn.Sequential(nn.Linear(4, 4), StashLinear(4))))


@skippable(stash=["a"], pop=["a"])
class Both(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        a = yield pop("a")
        yield stash("a", a)
        return x


def test_verify_both_stash_and_pop() -> None:
    with pytest.raises(TypeError, match="declares 'a' both in stash and in pop"):
        verify_skippables(nn.Sequential(Both()))


def test_pipe_verifies_at_construction() -> None:
    with pytest.raises(TypeError, match="no later layer pops it"):
        Pipe(nn.Sequential(StashLinear(4), nn.Linear(4, 4)), balance=[1, 1], devices=["cpu", "cpu"])


@skippable(stash=["a"])
class StashUndeclared(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("b", x)
        return x


@skippable(stash=["a"])
class StashForgotten(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


@skippable(pop=["a"])
class PopUndeclared(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield pop("b")
        return x


@skippable(stash=["a"])
class YieldsJunk(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield 42
        return x


def test_runtime_errors_name_the_skip() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(TypeError, match=r"stashed 'b' but declares stash=\['a'\]"):
        StashUndeclared()(x)
    with pytest.raises(TypeError, match=r"declares stash=\['a'\] but did not stash them"):
        StashForgotten()(x)
    with pytest.raises(TypeError, match="yield only stash"):
        YieldsJunk()(x)
    StashLinear(2)(x)  # stashes 'skip' in this thread's default tracker
    with pytest.raises(RuntimeError, match="'a' is popped but was not stashed"):
        PopUndeclared()(x)


def test_stash_takes_tensors_or_none() -> None:
    with pytest.raises(TypeError, match="only a tensor or None can be stashed"):
        stash("a", 3)  # type: ignore[arg-type]


def test_decorator_arguments_checked() -> None:
    with pytest.raises(TypeError, match=r"write stash=\['skip'\]"):
        skippable(stash="skip")
    with pytest.raises(TypeError, match="decorates an nn.Module class"):
        skippable(stash=["a"])(object)  # type: ignore[arg-type]


def test_isolate_checks_arguments() -> None:
    with pytest.raises(TypeError, match="takes a pipe.skip.Namespace"):
        StashLinear(4).isolate("ns")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"names \['nope'\] that StashLinear does not declare"):
        StashLinear(4).isolate(Namespace(), only=["nope"])
    ns = Namespace()
    assert StashLinear(4).isolate(ns, only=["skip"]).namespaced("skip") == (ns, "skip")
