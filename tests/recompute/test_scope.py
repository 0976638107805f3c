"""Scope: qualified names of the running submodules; name regexes with clear errors."""
from __future__ import annotations

import copy

import pytest
from recompute_models import blocks, sample

from pipe.recompute.scope import Scope, compile_pattern


def test_enclosing_names_while_running() -> None:
    block = blocks(n=1)[0]
    scope = Scope.of(block)
    assert Scope.of(block) is scope  # one scope per layer
    seen = []
    block.mlp.act.register_forward_pre_hook(lambda *_: seen.append((scope.enclosing(), scope.current())))
    block(sample())
    assert seen == [(["mlp", "mlp.act"], "mlp.act")]
    assert scope.enclosing() == [] and scope.current() == ""
    assert "attn.qkv" in scope.names


def test_copies_get_their_own_scope() -> None:
    block = blocks(n=1)[0]
    scope = Scope.of(block)
    clone = copy.deepcopy(block)
    assert Scope.of(clone) is not scope
    clone(sample())


def test_compile_pattern_errors() -> None:
    assert compile_pattern(r"mlp\.act", "x").fullmatch("mlp.act")
    with pytest.raises(ValueError, match=r"select_recompute regex 'a\[' is not a valid regular expression"):
        compile_pattern("a[", "select_recompute")
    with pytest.raises(TypeError, match="entries must be regex strings, got 3"):
        compile_pattern(3, "select_recompute")
