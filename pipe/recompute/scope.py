"""Scopes: which submodule of a layer is running, by its qualified name.

Selective recompute and op offload choose operations by regular expressions on
the qualified names of ``layer.named_modules()`` (``mlp.act``, ``attn``), as
MindFormers' ``select_recompute`` does on cell names. A :class:`Scope` puts a
forward pre-hook and a forward hook on every submodule of one layer and keeps,
per thread, the stack of names currently running, so that a dispatch mode or a
saved-tensor hook can ask where it is.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from torch import nn

__all__: list[str] = []


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.calls: Optional[dict[str, int]] = None  # calls per submodule, while counting


class _Enter:
    def __init__(self, scope: "Scope", name: str) -> None:
        self.scope = scope
        self.name = name

    def __call__(self, module: nn.Module, args: Any) -> None:
        local = self.scope._local
        local.stack.append(self.name)
        if local.calls is not None:
            local.calls[self.name] = local.calls.get(self.name, 0) + 1


class _Leave:
    def __init__(self, scope: "Scope") -> None:
        self.scope = scope

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.scope._local.stack
        if stack:
            stack.pop()


_SCOPE = "_pipe_recompute_scope"


class Scope:
    """The running submodule of ``layer``, per thread.

    Use :meth:`of` rather than the constructor: a layer gets one scope however
    many policies are put on it.

    Args:
        layer: the layer whose submodules are tracked (names are relative to it).
    """

    @classmethod
    def of(cls, layer: nn.Module) -> "Scope":
        """The scope of ``layer``, created (hooks registered) on first use."""
        scope = layer.__dict__.get(_SCOPE)
        if scope is None:
            scope = layer.__dict__[_SCOPE] = cls(layer)
        return scope

    def __init__(self, layer: nn.Module) -> None:
        self._local = _Local()
        self.names = [name for name, _ in layer.named_modules() if name]
        for name, sub in layer.named_modules():
            if not name:
                continue
            sub.register_forward_pre_hook(_Enter(self, name))
            sub.register_forward_hook(_Leave(self), always_call=True)

    @contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        """Counts the calls of each submodule in the body (this thread)."""
        calls: dict[str, int] = {}
        previous, self._local.calls = self._local.calls, calls
        try:
            yield calls
        finally:
            self._local.calls = previous

    def enclosing(self) -> list[str]:
        """Qualified names of the running submodules, outermost first ('' at the layer itself)."""
        return list(self._local.stack)

    def current(self) -> str:
        """The innermost running submodule's qualified name, '' at the layer itself."""
        stack = self._local.stack
        return stack[-1] if stack else ""

    # A threading.local cannot be copied: copies of a marked model get a fresh one.
    def __getstate__(self) -> dict[str, Any]:
        return {"names": self.names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.names = state["names"]
        self._local = _Local()


def compile_pattern(pattern: Any, what: str) -> "re.Pattern[str]":
    """Compiles a name regex of a config or policy, with an error that names it.

    Args:
        pattern: the regular expression (matched with ``fullmatch``).
        what: where it comes from, for the message (e.g. ``"select_recompute"``).

    Raises:
        TypeError: ``pattern`` is not a string.
        ValueError: ``pattern`` is not a valid regular expression.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{what} entries must be regex strings, got {pattern!r} ({type(pattern).__name__})")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"{what} regex {pattern!r} is not a valid regular expression ({exc}); "
            r"names are matched with re.fullmatch, escape a literal dot as '\.' (e.g. 'mlp\.act')"
        ) from None
