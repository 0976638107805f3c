"""Deprecated names: old public names kept for one release, each warning once per use with its new name.

Issue 23 gave each concept one name and each file a name of its own. Users may
import the old names, so they keep working for one release: a module that
moved leaves a module ``__getattr__`` behind (:func:`moved`), a function that
was renamed an alias (:func:`renamed`). Each use warns with a
``DeprecationWarning`` that names the replacement.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any, Callable, Iterable, Mapping, TypeVar, Union

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def moved(old_module: str, new_module: str, names: Union[Iterable[str], Mapping[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old_module`` whose ``names`` now live in ``new_module``.

    ``names`` lists the names that kept their name, or maps old names to new ones.

    Usage (the whole body of the old module)::

        __getattr__ = moved(__name__, "pipe.core.sequential", ["PipeSequential"])
        __getattr__ = moved(__name__, __name__, {"Cell": "Span"})   # a rename in place
    """
    known = dict(names) if isinstance(names, Mapping) else {name: name for name in names}

    def __getattr__(name: str) -> Any:
        if name not in known:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warn(f"{old_module}.{name}", f"{new_module}.{known[name]}")
        return getattr(importlib.import_module(new_module), known[name])

    return __getattr__


def renamed(function: F, old: str, new: str) -> F:
    """``function`` under its old name ``old``: warns that ``new`` replaces it, then calls it."""

    @functools.wraps(function)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn(old, new)
        return function(*args, **kwargs)

    return alias  # type: ignore[return-value]
