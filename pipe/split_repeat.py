"""Capturing a stack of alike layers once: ``torch.export`` runs two layers, the graph repeats the second.

``torch.export`` traces every op of the forward in Python, about a
millisecond or two each: a 24-layer LLaMA of 0.5B parameters takes ten
seconds to capture, on ``meta`` as on any device, almost all of it in the
decoder layers, which are the same code over different weights. So
:func:`capture` exports the model with its stack of layers (the longest
outermost ``nn.ModuleList``) cut to its first two entries, checks that the
two traced layers are the same graph, and writes the second one's ops again
for each further layer, over that layer's weights::

    exported:  embed ─ rotary ─ [layers.0] ─ [layers.1] ─ norm ─ head
    repeated:  embed ─ rotary ─ [layers.0] ─ [layers.1] ─ [layers.2] ─ ... ─ [layers.23] ─ norm ─ head

The result is the graph a whole export would have given (the same ops, in the
same order, reading the same values; ``tests/test_split_repeat.py`` compares
them op by op on LLaMA, Qwen2 and GPT-2), so everything after the capture in
:func:`pipe.split` is unchanged. It is used only where the layers cannot
differ in what they trace:

* every layer is the same tree of module classes, with parameters and buffers
  of the same names, shapes and dtypes, and the same plain attributes (ints,
  floats, strings, bools) but ``layer_idx``: a sliding-window layer among full
  ones (``sliding_window``), a layer without rotary embeddings (``use_rope``)
  or other sizes differ there, and the whole model is exported;
* no list in the model's HF config with one entry per layer (``layer_types``,
  which Qwen2's forward reads by index to pick each layer's mask) has entries
  that differ;
* no module inside the layers has hooks;
* the two traced layers are the same ops with the same constants, read the
  same values from outside (mask, rotary tables, sizes), pass one state from
  the first to the second, and nothing else runs between them;
* no cut point lies inside a layer.

Anything else (or an export of the shortened model that fails, e.g. a forward
that indexes its layers by the config's count) falls back to exporting the
whole model, which is always right. What remains possible is a forward whose
Python branches on a layer's index without storing anything on the layer;
``pipe.split(..., repeat=False)`` exports every layer for such a model.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed.pipelining  # noqa: F401  (registers the cut marker op, torch.ops.pippy._pipe_split)
from torch import fx, nn
from torch.utils import _pytree

from pipe.split_blocks import runs_in
from pipe.split_stage import attach

__all__: list[str] = []

logger = logging.getLogger(__name__)

_PLAIN = (int, float, str, bool, type(None))


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], points: list[str],
            export: Callable[..., torch.export.ExportedProgram]) -> Optional[fx.GraphModule]:
    """The graph of ``model``'s forward with cut markers before ``points``, exported with two of its layers and
    the rest repeated; None where that cannot be done exactly (the caller exports the whole model).

    ``export(model, args, kwargs, points)`` is :func:`pipe.graph_split._export`.
    """
    stack = _stack(model)
    if stack is None:
        return None
    path, layers = stack
    why = _unlike(layers) or _per_layer_settings(getattr(model, "config", None), len(layers))
    if why:
        logger.info("pipe.split: exporting all %d layers of %s: %s", len(layers), path, why)
        return None
    paths = [f"{path}.{i}" for i in range(len(layers))]
    inside = tuple(f"{p}." for p in paths)
    if any(p.startswith(inside) for p in points):
        return None
    marked = [p for p in points if p in paths]
    owner_path, _, name = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    whole = owner._modules[name]
    owner._modules[name] = nn.ModuleList(list(layers[:2]))
    try:
        program = export(model, args, kwargs, [p for p in points if p not in marked])
    except Exception as error:  # whatever fails here, the whole export below is the answer
        logger.info("pipe.split: exporting all %d layers of %s: two of them alone do not export (%s: %s)",
                    len(layers), path, type(error).__name__, str(error).strip().splitlines()[0:1])
        return None
    finally:
        owner._modules[name] = whole
    graph_module = program.module()
    for layer, layer_path in zip(layers[2:], paths[2:]):
        for key, tensor in list(layer.named_parameters(recurse=True)) + list(layer.named_buffers(recurse=True)):
            attach(graph_module, f"{layer_path}.{key}", tensor)
    why = _repeat(graph_module, paths)
    if why:
        logger.info("pipe.split: exporting all %d layers of %s: %s", len(layers), path, why)
        return None
    nodes = list(graph_module.graph.nodes)
    for point in marked:
        first = next(node for node in nodes if node.op == "call_function" and runs_in(node, point))
        with graph_module.graph.inserting_before(first):
            graph_module.graph.call_function(torch.ops.pippy._pipe_split.default, ())
    graph_module.graph.lint()
    graph_module.recompile()
    logger.info("pipe.split: exported 2 of the %d alike layers of %s and repeated the second's graph",
                len(layers), path)
    return graph_module


def _stack(model: nn.Module) -> Optional[tuple[str, list[nn.Module]]]:
    """The longest ``nn.ModuleList`` of 3 or more layers that is not inside another list's layer."""
    lists = [(path, module) for path, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and path and len(module) >= 3]
    outermost = [(path, module) for path, module in lists
                 if not any(path.startswith(f"{other}.") for other, _ in lists if other != path)]
    if not outermost:
        return None
    path, module = max(outermost, key=lambda item: len(item[1]))
    return path, list(module)


def _unlike(layers: list[nn.Module]) -> str:
    """Why ``layers`` may trace differently ('' if they cannot)."""
    first = _signature(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        if _hooked(layer):
            return f"layer {index} has hooks"
        if _signature(layer) != first:
            return f"layer {index} differs from layer 0 (classes, tensor shapes or settings)"
    return "layer 0 has hooks" if _hooked(layers[0]) else ""


def _per_layer_settings(config: Any, count: int) -> str:
    """Why a HF config says the layers differ ('' if it does not): a list of one entry per layer (``layer_types``,
    ``no_rope_layers``, ...) whose entries are not all equal. Forwards read such lists by the layer's index
    (Qwen2 picks each layer's mask from ``config.layer_types[i]``)."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return ""
    found: list[str] = []

    def walk(settings: dict[str, Any], prefix: str) -> None:
        for key, value in settings.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, (list, tuple)) and len(value) == count and len(set(map(repr, value))) > 1:
                found.append(f"{prefix}{key}")
    walk(to_dict(), "")
    return f"the config sets {', '.join(found)} per layer, not alike" if found else ""


def _signature(layer: nn.Module) -> list[Any]:
    signature: list[Any] = []
    for name, module in layer.named_modules(remove_duplicate=False):
        settings = sorted((key, value) for key, value in vars(module).items()
                          if not key.startswith("_") and key not in ("training", "layer_idx") and _plain(value))
        tensors = [(key, tuple(t.shape), t.dtype, t.requires_grad, type(t))
                   for key, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]
        signature.append((name, type(module), settings, tensors, sorted(module._non_persistent_buffers_set)))
    return signature


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def _hooked(layer: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               or m._state_dict_hooks or m._load_state_dict_pre_hooks for m in layer.modules())


class _Ref:
    """An argument of a layer's op, as the comparison of two layers sees it: one of its own ops by position, one
    of its weights by relative name, or a value from outside it (by identity)."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any) -> None:
        self.kind, self.value = kind, value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Ref) and self.kind == other.kind
                and (self.value is other.value if self.kind == "outside" else self.value == other.value))

    def __hash__(self) -> int:
        return hash((self.kind, id(self.value) if self.kind == "outside" else self.value))

    def __repr__(self) -> str:
        return f"{self.kind} {getattr(self.value, 'name', self.value)}"


def _repeat(graph_module: fx.GraphModule, paths: list[str]) -> str:
    """Writes the ops of layer ``paths[1]`` again for each of ``paths[2:]``; why it cannot ('' when done)."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    ops = [[n for n in nodes if n.op == "call_function" and runs_in(n, p)] for p in paths[:2]]
    if not ops[0] or len(ops[0]) != len(ops[1]):
        return "the two exported layers do not run the same number of ops"
    position = {node: i for i, node in enumerate(nodes)}
    span = [n for n in nodes[position[ops[0][0]]:position[ops[1][-1]] + 1] if n.op != "get_attr"]
    if span != ops[0] + ops[1]:
        return "other ops run between or inside the two exported layers"
    index = [{node: i for i, node in enumerate(layer)} for layer in ops]
    members = set(ops[0]) | set(ops[1])
    if any(user not in members for node in ops[0] for user in node.users):
        return "a value of the first layer is used after the second"
    prefixes = [f"{p}." for p in paths]

    def shape(node: fx.Node, k: int) -> Any:
        def token(arg: fx.Node) -> _Ref:
            if arg in index[k]:
                return _Ref("op", index[k][arg])
            if arg.op == "get_attr" and str(arg.target).startswith(prefixes[k]):
                return _Ref("weight", str(arg.target)[len(prefixes[k]):])
            return _Ref("outside", arg)
        return node.target, fx.node.map_arg(cast(Any, (node.args, node.kwargs)), cast(Any, token))

    carried: dict[fx.Node, fx.Node] = {}  # what layer 0 reads from before it -> the value of layer 0 layer 1 reads
    for first, second in zip(*ops):
        leaves, spec = _pytree.tree_flatten(shape(first, 0))
        others, other_spec = _pytree.tree_flatten(shape(second, 1))
        if spec != other_spec:
            return f"the layers' ops differ ({first.target} against {second.target})"
        for a, b in zip(leaves, others):
            if a == b:
                continue
            if (isinstance(a, _Ref) and isinstance(b, _Ref) and a.kind == b.kind == "outside"
                    and b.value in index[0] and carried.setdefault(a.value, b.value) is b.value):
                continue
            return f"the layers' ops differ at {second.name} ({a!r} against {b!r})"

    def rename(meta: dict[str, Any], path: str) -> dict[str, Any]:
        meta = dict(meta)
        stack = meta.get("nn_module_stack")
        if stack:
            meta["nn_module_stack"] = {
                key: ((path + entry[0][len(paths[1]):], *entry[1:])
                      if entry[0] == paths[1] or entry[0].startswith(prefixes[1]) else entry)
                for key, entry in stack.items()}
        return meta

    previous = ops[1]
    anchor = ops[1][-1]
    for k in range(2, len(paths)):
        made: list[fx.Node] = []
        weights: dict[str, fx.Node] = {}

        def value(arg: fx.Node) -> fx.Node:
            if arg in index[1]:
                return made[index[1][arg]]
            if arg in index[0]:
                return previous[index[0][arg]]
            if arg.op == "get_attr" and str(arg.target).startswith(prefixes[1]):
                target = prefixes[k] + str(arg.target)[len(prefixes[1]):]
                if target not in weights:
                    with graph.inserting_before(ops[0][0]):
                        weights[target] = graph.get_attr(target)
                    weights[target].meta = dict(arg.meta)
                return weights[target]
            return arg

        for node in ops[1]:
            with graph.inserting_after(anchor):
                copy = graph.node_copy(node, value)
            copy.meta = rename(node.meta, paths[k])
            made.append(copy)
            anchor = copy
        previous = made
    end = position[ops[1][-1]]
    for node in ops[1]:  # its users after it now use the last layer (copies are new: no position)
        node.replace_all_uses_with(previous[index[1][node]], delete_user_cb=lambda user: position.get(user, -1) > end)
    return ""
