"""A split stage's layers as modules of their own: the ops one layer ran, outlined into a call at its path.

``torch.export`` flattens the model: in a :class:`pipe.split_stage.SplitStage`
a decoder layer is a run of aten ops over get-attrs of its weights, with no
module call that FSDP's hooks, a recompute boundary or ``torch.compile`` could
hold on to. Each op still records the modules it ran in (``nn_module_stack``),
so the ops of one layer can be gathered back into a graph of their own, a
:class:`SplitBlock` installed at the layer's path (``model.layers.3``) in
place of the empty holder of its weights::

    Stage0:  embed ─ [ops of layers.0] ─ [ops of layers.1] ─ norm
        ->   embed ─ model.layers.0(h, cos, sin, mask) ─ model.layers.1(...) ─ norm

The block holds the same parameter objects under the same names, so the
stage's state dict, its original names and ties are unchanged; the stage now
calls each layer as a module, which is what makes a layer an FSDP unit of its
own (:mod:`pipe.distributed.fsdp`). :func:`outline_layers` outlines the
entries of the model's ``nn.ModuleList``s (the repeated layers), then the
other modules that hold parameters of their own (an embedding, the final
norm, the LM head), so that each is a unit of its own; a module that
cannot be outlined (its weight is read outside it, or an op between its ops
both uses and feeds it) stays as ops, and the stage works as before.
"""
from __future__ import annotations

import logging
import operator
import re
from typing import Any, cast

from torch import fx, nn

__all__: list[str] = []

logger = logging.getLogger(__name__)


class SplitBlock(fx.GraphModule):
    """One layer of a split stage: the graph of the ops it ran, over its own parameters.

    Alike layers share one class. ``fx.GraphModule`` gives each module a class
    of its own (its code is the class's ``forward``), and ``torch.compile``
    guards on the class, so every layer would compile again. A block's values
    are named by their place in the layer (:func:`outline`), so alike layers
    have the same code, and a block takes the class of the first block with
    its code (:func:`_share`). A block whose graph changes later (a
    recompile: tensor parallelism's head counts, a device) leaves that class
    for one of its own first, then joins the class of its new code; so does
    a recompile after FSDP has given the blocks its class over theirs.

    Attributes:
        path: the layer's path in the model (``"model.layers.3"``).
    """

    path: str

    def recompile(self) -> Any:
        # The new code goes to a class of its own (others may share this one: alike blocks, or FSDP's class
        # over theirs), which then joins the class of the blocks with that code.
        cls = type(self)
        own = type(cls.__name__, cls.__bases__, {"__qualname__": cls.__qualname__})
        wrapped = getattr(cls, "_wrapped_call", None)
        if wrapped is not None and issubclass(own, wrapped.cls):
            # A class over another graph module's class (FSDP's): call through that one's wrapper. fx would
            # make a wrapper that calls the base's __call__, which calls this wrapper again, without end.
            own._wrapped_call = wrapped  # type: ignore[attr-defined]
        self.__class__ = own
        code = super().recompile()
        if "path" in self.__dict__:  # a block being made (outline, a copy) joins its class once it is named
            _share(self)
        return code

    def __deepcopy__(self, memo: dict[int, Any]) -> "SplitBlock":
        """A copy that is a block too (``GraphModule``'s copy keeps the graph, the tensors and the class only)."""
        name = type(self).__name__
        result = super().__deepcopy__(memo)  # recompiled under GraphModule's name: its class is its own
        result.__dict__["path"] = self.path
        type(result).__name__ = name
        _share(cast("SplitBlock", result))
        return cast("SplitBlock", result)  # a GraphModule to torch 2.13's types


# (the bases of a block's class, its name, its code) -> the class the blocks with that code share
_SHARED: dict[tuple[tuple[type, ...], str, str], type] = {}


def _share(block: SplitBlock) -> None:
    """Moves ``block`` to the class of the blocks with its code, bases and name, or makes its class that class.

    The name is the layer's class name (:func:`outline_layers`): a LLaMA's norm and a Qwen3's have the same code,
    and a block keeps its own model's name whatever was split before it in the process."""
    cls = type(block)
    key = (cls.__bases__, cls.__name__, block.code)
    shared = _SHARED.setdefault(key, cls)
    if shared is not cls:
        block.__class__ = shared


def repeated_layers(model: nn.Module) -> list[str]:
    """The paths of the entries of ``model``'s ``nn.ModuleList``s that hold parameters, in the model's order."""
    paths = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for index, layer in module.named_children():
                if any(True for _ in layer.parameters()):
                    paths.append(f"{name}.{index}" if name else index)
    return paths


def other_holders(model: nn.Module, layers: list[str]) -> list[str]:
    """The paths of ``model``'s modules outside ``layers`` that hold parameters of their own (an embedding, the
    final norm, the head), in the model's order."""
    inside = tuple(f"{path}." for path in layers)
    return [name for name, module in model.named_modules()
            if name and name not in layers and not name.startswith(inside) and module._parameters
            and any(p is not None for p in module._parameters.values())]


def outline_layers(stage: fx.GraphModule, model: nn.Module) -> list[str]:
    """Outlines into :class:`SplitBlock`s each repeated layer of ``model`` that ``stage`` runs, then each other
    module with parameters of its own (embedding, norm, head); returns their paths in the stage's order."""
    layers = repeated_layers(model)
    candidates = layers + other_holders(model, layers)
    done = [path for path in candidates if outline(stage, path, type(model.get_submodule(path)).__name__)]
    calls = [str(node.target) for node in stage.graph.nodes if node.op == "call_module"]
    done.sort(key=calls.index)
    if done:
        stage.recompile()
        logger.info("pipe.split: %s runs %d layers as modules of their own (%s ... %s)", type(stage).__name__,
                    len(done), done[0], done[-1])
    return done


def runs_in(node: fx.Node, path: str) -> bool:
    """Whether the op ``node`` ran inside the module at ``path`` (its ``nn_module_stack``, as ``torch.export``
    records it)."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(entry[0] == path for entry in stack.values())


def outline(stage: fx.GraphModule, path: str, class_name: str = "SplitBlock") -> bool:
    """Replaces the ops ``stage`` runs in module ``path`` by one call of a :class:`SplitBlock` at ``path``.

    Returns False, changing nothing, when the stage holds no weight of that
    module, runs none of its ops, reads one of its weights outside it, or
    interleaves an op that both uses the layer's results and feeds the layer.
    The caller recompiles the stage.
    """
    try:
        holder = stage.get_submodule(path)
    except AttributeError:
        return False
    if isinstance(holder, SplitBlock) or type(holder) is not nn.Module:
        return False
    graph = stage.graph
    nodes = list(graph.nodes)
    prefix = f"{path}."
    weights = [n for n in nodes if n.op == "get_attr" and str(n.target).startswith(prefix)]
    body = [n for n in nodes if n.op == "call_function" and runs_in(n, path)]
    if not weights or not body:
        return False
    inside = set(body) | set(weights)
    if any(user not in inside for weight in weights for user in weight.users):
        logger.debug("pipe.split: %s stays as ops: a weight of it is read outside it", path)
        return False
    position = {node: i for i, node in enumerate(nodes)}
    first, last = position[body[0]], position[body[-1]]
    after: list[fx.Node] = []  # ops between the layer's ops that use its results: moved after its call
    for node in nodes[first:last + 1]:
        if node in inside:
            if any(source in after for source in node.all_input_nodes):
                logger.debug("pipe.split: %s stays as ops: %s both uses and feeds it", path, after[0].name)
                return False
        elif any(source in inside or source in after for source in node.all_input_nodes):
            after.append(node)
    inputs: list[fx.Node] = []
    for node in body:
        for source in node.all_input_nodes:
            if source not in inside and source not in inputs:
                inputs.append(source)
    outputs = [node for node in body if any(user not in inside for user in node.users)]

    # Values are named by their place in the layer (input_0, ..., mul_0, mul_1, ...), not by the stage's
    # numbering: alike layers then have the same code, which torch.compile compiles once (pipe.compile).
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, node in enumerate(inputs):
        env[node] = sub.placeholder(f"input_{k}")
        env[node].meta = dict(node.meta)
    for node in weights:
        env[node] = sub.get_attr(str(node.target)[len(prefix):])
        env[node].meta = dict(node.meta)
    counts: dict[str, int] = {}
    for node in body:
        base = re.sub(r"(_\d+)+$", "", node.name)
        counts[base] = counts.get(base, -1) + 1
        env[node] = sub.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                    fx.map_arg(node.kwargs, env.__getitem__), name=f"{base}_{counts[base]}",
                                    type_expr=node.type)
        env[node].meta = dict(node.meta)
    results = [env[node] for node in outputs]
    sub.output(results[0] if len(results) == 1 else tuple(results))
    sub.lint()
    block = SplitBlock(holder, sub, class_name=class_name)
    # The holder's whole tree (weights the graph does not read too), the same objects under the same names.
    block._modules = holder._modules
    block._parameters = holder._parameters
    block._buffers = holder._buffers
    block._non_persistent_buffers_set = holder._non_persistent_buffers_set
    block.path = path
    _share(block)
    block.train(holder.training)
    parent_path, _, name = path.rpartition(".")
    stage.get_submodule(parent_path).add_module(name, block)

    with graph.inserting_after(body[-1]):
        call = graph.call_module(path, tuple(inputs))
    call.meta["nn_module_stack"] = dict(body[-1].meta.get("nn_module_stack") or {})
    anchor: fx.Node = call
    if len(outputs) == 1:
        call.meta["val"] = outputs[0].meta.get("val")
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda user: user not in inside)
    else:
        call.meta["val"] = tuple(node.meta.get("val") for node in outputs)
        for index, node in enumerate(outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, index))
            item.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
            anchor = item
    for node in after:
        anchor.append(node)
        anchor = node
    for node in reversed(body):
        graph.erase_node(node)
    for node in weights:
        graph.erase_node(node)
    graph.lint()
    return True


def blocks_of(stage: nn.Module) -> list[SplitBlock]:
    """The outlined layers of ``stage``, in its order."""
    return [module for module in stage.modules() if isinstance(module, SplitBlock)]
