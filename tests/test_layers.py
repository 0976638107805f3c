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
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipe"

PLANNER_MODEL = ["pipe.plan.cost", "pipe.plan.host_copy", "pipe.plan.timing", "pipe.plan.candidate",
                 "pipe.plan.candidates", "pipe.plan.predict", "pipe.plan.sharding", "pipe.plan.search"]

# Bottom to top. The first pattern that matches a module decides: an exact name, or a prefix ending in ".".
LAYERS: list[tuple[str, list[str]]] = [
    ("recording", ["pipe.trace", "pipe.trace."]),
    ("core", ["pipe.core", "pipe.core."]),
    ("observation", ["pipe.viz", "pipe.viz."]),
    ("features", ["pipe.skip", "pipe.skip.", "pipe.recompute", "pipe.recompute.", "pipe.balance", "pipe.balance.",
                  "pipe.batchnorm", "pipe.compile", "pipe.spec"]),
    ("runners", ["pipe.threads", "pipe.threads.", "pipe.distributed."]),
    # The planner's model: costs, candidates, prediction over a schedule, search; no torch (checked below).
    ("planner model", PLANNER_MODEL),
    ("front ends", ["pipe", "pipe.pipe", "pipe.graph_split", "pipe.split_stage", "pipe.split_blocks",
                    "pipe.split_repeat",
                    "pipe.distributed",
                    "pipe.distributed.distributed_pipe", "pipe.distributed.names", "pipe.distributed.hf",
                    "pipe.viz.cli", "pipe.viz.__main__"]),
    # The planner's driver: it measures the model and the machine (profile, link, calibration, verify) and
    # builds the front ends from a plan (pipe.plan.planned_pipe); nothing below imports it.
    ("planner driver", ["pipe.plan", "pipe.plan."]),
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
    ("pipe.plan.cli", "planner driver"), ("pipe.plan.search", "planner model"), ("pipe.plan.link", "planner driver"),
    ("pipe.plan.apply", "planner driver"), ("pipe.plan", "planner driver"), ("pipe.trace.events", "recording"),
])
def test_layer_of(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module)][0] == layer


def test_an_unplaced_module_is_refused() -> None:
    with pytest.raises(LookupError, match="pipe.newthing"):
        layer_of("pipe.newthing")


# Import circles between packages -----------------------------------------------------------------------


def package_of(module: str) -> str:
    """The package a module belongs to for the circle check: ``pipe.core.schedule`` is pipe.core, a top-level
    module (``pipe.pipe``) is its own, and ``pipe`` (the root ``__init__``) is pipe."""
    return ".".join(module.split(".")[:2])


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The sets of two or more nodes of ``edges`` (node -> the nodes it points to) that reach each other,
    each sorted (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {b for targets in edges.values() for b in targets}):
        if node not in order:
            visit(node)
    return found


def package_cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The circles between the packages of ``arrows`` (module -> the modules it imports): each strongly
    connected set of two or more packages, sorted, one ``"a -> b (module -> module)"`` line per arrow in it."""
    edges: dict[str, dict[str, str]] = {}
    for module, targets in sorted(arrows.items()):
        for target in sorted(targets):
            a, b = package_of(module), package_of(target)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, f"{module} -> {target}")
    return [[f"{a} -> {b} ({why})" for a in members for b, why in sorted(edges[a].items()) if b in members]
            for members in strongly_connected({a: set(targets) for a, targets in edges.items()})]


def module_cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The circles between modules of one package: each strongly connected set of two or more modules."""
    return strongly_connected({module: {t for t in targets if package_of(t) == package_of(module)}
                               for module, targets in arrows.items()})


def test_no_import_circle_between_packages() -> None:
    """pipe.core, pipe.distributed, pipe.plan, pipe.pipe, ...: no package imports one that imports it back,
    however indirectly (a lazy import counts; so does ``from pipe import Pipe``, which is the root package)."""
    cycles = package_cycles(graph())
    assert not cycles, "import circles between packages:\n" + "\n\n".join("\n".join(c) for c in cycles)


def test_the_circle_check_finds_a_circle() -> None:
    """The check is the test's own code: a circle through three packages, with a module-level arrow inside one
    package that does not count, is found whole."""
    arrows = {"pipe.pipe": {"pipe.plan.apply"}, "pipe.plan.apply": {"pipe.plan.search", "pipe.distributed.mesh"},
              "pipe.plan.search": {"pipe.core.schedule"}, "pipe.distributed.mesh": {"pipe.pipe"},
              "pipe.core.schedule": set()}
    assert package_cycles(arrows) == [["pipe.distributed -> pipe.pipe (pipe.distributed.mesh -> pipe.pipe)",
                                       "pipe.pipe -> pipe.plan (pipe.pipe -> pipe.plan.apply)",
                                       "pipe.plan -> pipe.distributed (pipe.plan.apply -> pipe.distributed.mesh)"]]
    del arrows["pipe.distributed.mesh"]
    assert package_cycles(arrows) == []
    assert module_cycles({"pipe.core.a": {"pipe.core.b"}, "pipe.core.b": {"pipe.core.a", "pipe.plan.c"},
                          "pipe.plan.c": {"pipe.core.a"}}) == [["pipe.core.a", "pipe.core.b"]]


# The circles between modules of one package that remain, counted: a new one, or one grown, fails. Each is a
# module that imports another lazily (inside a function) to use it at run time; pipe.core has none.
MODULE_CIRCLES = [
    ["pipe.distributed.env", "pipe.distributed.group", "pipe.distributed.mesh"],
    ["pipe.plan.candidate", "pipe.plan.candidates", "pipe.plan.predict", "pipe.plan.sharding", "pipe.plan.timing"],
    ["pipe.recompute.op_decisions", "pipe.recompute.replay"],
    ["pipe.skip.layout", "pipe.skip.skippable", "pipe.skip.tracker"],
]


def test_the_import_circles_inside_packages_are_the_counted_ones() -> None:
    found = sorted(module_cycles(graph()))
    assert found == MODULE_CIRCLES, (f"import circles inside packages: {found}; a new or grown circle is to be "
                                     f"broken, a broken one removed from MODULE_CIRCLES")


# The planner's model needs no torch ------------------------------------------------------------------------


def test_the_planner_model_imports_no_torch() -> None:
    """Every module of the planner's model imports, and a search with FSDP splits runs, with torch blocked.

    As for pipe.core.schedule (tests/core/test_schedule.py), the packages' ``__init__`` files are not run (they
    re-export torch modules); the modules themselves, and every pipe module they import, must do without torch.
    """
    packages = {module_name(path): str(path.parent) for path in PACKAGE.rglob("__init__.py")}
    code = f"""
import importlib, importlib.abc, sys, types

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the planner's model imported {{name}}")

sys.meta_path.insert(0, NoTorch())
for name, folder in {packages!r}.items():
    package = types.ModuleType(name)
    package.__path__ = [folder]
    sys.modules[name] = package
for name in {PLANNER_MODEL!r}:
    importlib.import_module(name)
from pipe.plan.cost import Costs
from pipe.plan.search import search
from pipe.plan.timing import Link, TimeModel
costs = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [1000] * 4, [100] * 4, param_bytes=[10**5] * 4)
model = TimeModel(link=Link(latency=1e-4, per_byte=1e-9), action_overhead=1e-4)
plan = search(costs, 4, "1GiB", runner="processes", dp_shard="auto", model=model)
assert plan.table().startswith("memory budget 1.00 GiB per rank"), plan.table()
assert not any(name == "torch" or name.startswith("torch.") for name in sys.modules)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
