"""The public surface is the packages' ``__all__``; every other module declares ``__all__ = []``.

The API reference is built from ``pipe.__all__`` and the public packages'
``__all__``. A module inside them is internal: its names are reached through
its package (``pipe.skip.stash``), so it exports nothing of its own and its
internals do not look public.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipe"

PUBLIC = {"pipe", "pipe.balance", "pipe.distributed", "pipe.plan", "pipe.recompute", "pipe.skip", "pipe.trace",
          "pipe.viz", "pipe.batchnorm", "pipe.distributed.state", "pipe.distributed.hf"}

def declared_all(path: Path) -> object:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return ast.literal_eval(node.value) if node.value is not None else None  # type: ignore[union-attr]
    return None


def internal_modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if name not in PUBLIC and parts[-1] != "__main__" and path.name != "__init__.py":
            found.append((name, path))
    return found


@pytest.mark.parametrize("name, path", internal_modules(), ids=[name for name, _ in internal_modules()])
def test_an_internal_module_exports_nothing(name: str, path: Path) -> None:
    assert declared_all(path) == [], f"{name} is internal: declare __all__: list[str] = [] (its package exports)"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_is_importable(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_skip_exports_only_what_a_user_writes() -> None:
    import pipe.skip

    assert sorted(pipe.skip.__all__) == ["Namespace", "pop", "skippable", "stash", "verify_skippables"]
