"""The layers of docs/design.md, checked on the code's own imports.

A module imports only from its own layer or the layers below it; the two
runners share only what lies below them. Every ``import`` and ``from ...
import`` counts, at the top of a module or inside a function (a lazy import is
still an arrow). Modules are mapped to layers by their dotted name, so a new
module under ``pipe/distributed/`` (a device-mesh module, say) is a runner
module and held to the rule without a change here; a new top-level module or
package must be placed in ``LAYERS`` first.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipe"

# Bottom to top. The first pattern that matches a module decides: an exact name, or a prefix ending in ".".
LAYERS: list[tuple[str, list[str]]] = [
    ("recording", ["pipe.trace", "pipe.trace."]),
    ("core", ["pipe.core", "pipe.core."]),
    ("observation", ["pipe.viz", "pipe.viz."]),
    ("features", ["pipe.skip", "pipe.skip.", "pipe.recompute", "pipe.recompute.", "pipe.balance", "pipe.balance.",
                  "pipe.batchnorm", "pipe.compile", "pipe.spec"]),
    ("runners", ["pipe.threads", "pipe.threads.", "pipe.distributed."]),
    ("front ends", ["pipe", "pipe.pipe", "pipe.graph_split", "pipe.split_stage", "pipe.distributed",
                    "pipe.distributed.distributed_pipe", "pipe.distributed.names", "pipe.distributed.hf",
                    "pipe.distributed.step_inputs", "pipe.viz.cli", "pipe.viz.__main__", "pipe.plan", "pipe.plan.",
                    "pipe.sequential", "pipe.tied"]),
]

# Layers whose packages must not import each other: the thread and the process runner share only core.
SIBLINGS = {"pipe.threads": "pipe.distributed", "pipe.distributed": "pipe.threads"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index of ``module``'s layer: the most specific pattern over all layers wins."""
    best, length = -1, -1
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            hit = module.startswith(pattern) if pattern.endswith(".") else module == pattern
            if hit and len(pattern) > length:
                best, length = index, len(pattern)
    if best < 0:
        raise LookupError(f"{module} is in no layer of tests/test_layers.py: place it in LAYERS (and docs/design.md)")
    return best


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The ``pipe`` modules that ``module`` imports anywhere in its body (``from pipe import trace`` is pipe.trace)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {name for name in found if name == "pipe" or name.startswith("pipe.")}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {module: imports(module, path, known) for module, path in found.items()}


def test_every_module_has_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    broken = []
    for module, targets in sorted(graph().items()):
        own = layer_of(module)
        for target in sorted(targets):
            if layer_of(target) > own:
                broken.append(f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not broken, "imports up the layers of docs/design.md:\n" + "\n".join(broken)


def test_the_runners_share_only_what_lies_below_them() -> None:
    broken = []
    for module, targets in sorted(graph().items()):
        for mine, other in SIBLINGS.items():
            if module.startswith(mine + ".") and layer_of(module) == layer_of(mine + ".x"):
                broken += [f"{module} imports {t}" for t in sorted(targets) if t == other or t.startswith(other + ".")]
    assert not broken, "one runner imports the other:\n" + "\n".join(broken)


def test_the_graph_reads_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The parser is the test's own code: a lazy import and a ``from pipe import <module>`` are arrows."""
    source = tmp_path / "m.py"
    source.write_text("from pipe import trace\n\ndef f():\n    from pipe.threads.worker import Workers\n")
    found = imports("pipe.core.m", source, {"pipe.trace", "pipe.threads.worker"})
    assert found == {"pipe.trace", "pipe.threads.worker"}


@pytest.mark.parametrize("module, layer", [
    ("pipe.distributed.mesh", "runners"), ("pipe.distributed.distributed_pipe", "front ends"), ("pipe.distributed.names", "front ends"), ("pipe.compile", "features"),
    ("pipe.core.schedule", "core"), ("pipe.viz.cli", "front ends"), ("pipe.viz.idle", "observation"),
    ("pipe.plan.cli", "front ends"), ("pipe.plan.search", "front ends"), ("pipe.trace.events", "recording"),
])
def test_layer_of(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module)][0] == layer


def test_an_unplaced_module_is_refused() -> None:
    with pytest.raises(LookupError, match="pipe.newthing"):
        layer_of("pipe.newthing")
