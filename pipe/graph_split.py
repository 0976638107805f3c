"""``pipe.split``: cut any ``nn.Module`` at named submodules into stages that pass values positionally.

``Pipe`` and ``DistributedPipe`` run a sequence of layers. Most models are not
one: a transformer's blocks need the attention mask and the position
embeddings made at the top, the LM head reuses the embedding's weight. Rather
than have users write adapter layers, ``split`` captures the model's forward
as one graph with ``torch.export`` (PyTorch's own capture, as
``torch.distributed.pipelining.pipeline`` does; the cut points are the same
``pipe_split`` markers), and cuts the graph before each named submodule::

    graph:   embed ─ block0 ─┊─ block1 ─ norm ─ head        at=["h.1"]
    stages:  Stage0(ids, mask) -> (hidden, mask4d)  │  Stage1(hidden, mask4d) -> logits

Every value a later stage needs crosses each boundary in between (a stage
passes through what it does not use), as a tuple: the calling convention of
:class:`pipe.PipeSequential`, which ``split`` returns. Sizes and other
non-tensor values are recomputed where they are needed, so only tensors
cross. Each stage is an ``fx.GraphModule`` whose parameters are the original
model's parameter objects under their original paths; ``state_dict()`` of the
result (and of a ``Pipe`` or ``DistributedPipe`` around it) has the original
model's keys (:func:`keep_original_names`), tied weights included.

What cannot be split: see docs/split.md (data-dependent control flow, calls
of a cut module more than once, train/eval switches after capture).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from types import MethodType
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx, nn
from torch.export import Dim, ShapesCollection

from pipe.core.checkpoint import is_recomputing
from pipe.core.sequential import PipeSequential

__all__ = ["split", "SplitError", "SplitStage", "keep_original_names"]

logger = logging.getLogger(__name__)

DOCS = "docs/split.md"

# Ops whose result depends on train/eval mode, baked into the graph at capture.
_MODE_OPS = {
    torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default, torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default, torch.ops.aten.batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten.cudnn_batch_norm.default, torch.ops.aten.native_batch_norm.default,
}


class SplitError(RuntimeError):
    """The model cannot be captured as one graph, or a cut point cannot be used."""


class SplitStage(fx.GraphModule):
    """One stage of a split model: a graph over the original model's parameters.

    Attributes:
        original_keys: this stage's state-dict keys -> the original model's keys
            for the same tensor (several for tied weights).
        model_keys: every state-dict key of the original model, in its order.
        captured_training: the model's ``training`` flag at capture.
        mode_dependent: whether the graph has dropout or batch norm (fixed to the captured mode).
        input_count: how many tensors the stage takes.
        captured_batch_norm: whether the graph has batch norm in training mode (``deferred_batch_norm``
            cannot reach it).
    """

    original_keys: dict[str, list[str]]
    model_keys: tuple[str, ...]
    captured_training: bool
    mode_dependent: bool
    input_count: int
    captured_batch_norm: bool

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "SplitStage":
        super()._apply(fn, recurse)
        _retarget_devices(self)
        return self


def split(
    model: nn.Module,
    example_args: Any,
    example_kwargs: Optional[dict[str, Any]] = None,
    *,
    at: Sequence[str],
) -> PipeSequential:
    """Cuts ``model`` before each submodule named in ``at`` into a :class:`pipe.PipeSequential` of stages.

    Usage::

        model = GPT2LMHeadModel(config)
        stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False},
                            at=["transformer.h.2"])
        logits = stages(ids, mask)            # == model(ids, attention_mask=mask).logits
        pipe.Pipe(stages, chunks=4, balance=[1, 1])

    Args:
        model: any module whose forward ``torch.export`` can capture.
        example_args: positional inputs (a tuple, or one tensor) of one batch.
            Use a batch of at least 2 and the sizes you will train with; every
            dimension is captured as dynamic where the model allows it.
        example_kwargs: keyword inputs. Tensors among them become inputs of
            the split model; other values (``use_cache=False``) are fixed.
        at: module paths, e.g. ``["transformer.h.2"]``: a new stage begins
            where each of these modules is called. Each must run exactly once
            per forward.

    Returns:
        A ``PipeSequential`` of ``len(at) + 1`` stages. It takes the tensor
        inputs positionally, ``example_args`` first, then the tensors of
        ``example_kwargs`` in their order, and returns the model's output
        tensor (or a tuple of its output tensors, flattened). Parameters are
        the model's own objects: training either trains both.

    Raises:
        ValueError, TypeError: bad ``at`` or example inputs.
        SplitError: the model cannot be captured as one graph (for example
            data-dependent control flow), see docs/split.md.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"pipe.split takes an nn.Module, got {type(model).__name__}")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs or None, got {type(example_kwargs).__name__}")
    points = _verify_points(model, at)
    program = _export(model, example_args, example_kwargs or {}, points)
    graph_module = program.module()
    stages = _cut(graph_module, len(points) + 1)
    model_state = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, tensor in model_state.items():
        aliases.setdefault(id(tensor), []).append(key)
    used = {id(t) for stage in stages for t in stage.state_dict(keep_vars=True).values()}
    unused = [key for key, tensor in model_state.items() if id(tensor) not in used and aliases[id(tensor)][0] == key]
    for key in unused:  # kept, in the first stage, so that checkpoints still hold every key
        _attach(stages[0], key, model_state[key])
    if unused:
        logger.info("pipe.split: forward does not use %s; the first stage keeps them for the state dict", unused[:8])
    for stage in stages:
        _adopt_state(stage, model, aliases, tuple(model_state))
    result = PipeSequential(*stages)
    result.train(model.training)
    keep_original_names(result)
    logger.info("pipe.split: %s cut at %s into %d stages", type(model).__name__, list(points), len(stages))
    return result


# -- cut points --------------------------------------------------------------------------------------


def _verify_points(model: nn.Module, at: Sequence[str]) -> list[str]:
    if isinstance(at, str) or not all(isinstance(p, str) for p in at):
        raise TypeError(f"at must be a list of module paths such as ['transformer.h.2'], got {at!r}")
    points = list(at)
    if not points:
        raise ValueError("at is empty; name at least one module where a new stage begins, e.g. at=['layers.2']")
    if len(set(points)) != len(points):
        raise ValueError(f"at lists a module twice: {points}; name each cut point once")
    for path in points:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            children = [name for name, _ in model.named_modules() if name][:12]
            raise ValueError(
                f"at names {path!r} but {type(model).__name__} has no such submodule; "
                f"use a path from model.named_modules(), e.g. {children}"
            ) from None
        if module is model:
            raise ValueError("at names the model itself; name a submodule where a new stage begins")
    return points


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            points: list[str]) -> torch.export.ExportedProgram:
    from torch.distributed.pipelining import pipe_split

    calls: list[str] = []
    saved: list[tuple[nn.Module, Any]] = []

    def marked(path: str, module: nn.Module) -> Callable[..., Any]:
        forward = module.forward

        def split_before(self: nn.Module, *a: Any, **k: Any) -> Any:
            calls.append(path)
            pipe_split()
            return forward(*a, **k)
        return MethodType(split_before, module)

    shapes = ShapesCollection()
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            shapes[leaf] = (Dim.AUTO,) * leaf.dim()
    try:
        for path in points:
            module = model.get_submodule(path)
            saved.append((module, module.__dict__.get("forward")))
            module.forward = marked(path, module)
        try:
            program = torch.export.export(model, args, kwargs, dynamic_shapes=shapes.dynamic_shapes(model, args, kwargs))
        except Exception as error:  # torch.export raises many types; all mean "cannot capture"
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise SplitError(
                f"pipe.split could not capture {type(model).__name__}.forward as one graph with torch.export "
                f"({type(error).__name__}: {first}). Models whose Python control flow depends on tensor values "
                f"(if x.sum() > 0, loops over .item()) cannot be split; see {DOCS} ('What cannot be split') "
                f"for the fixes"
            ) from error
    finally:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward
    for path in points:
        count = calls.count(path)
        if count != 1:
            raise ValueError(
                f"module {path!r} ran {count} times in forward; a cut point must run exactly once "
                f"(name a module that forward calls once, such as one block of the stack)"
            )
    return program


# -- cutting the graph ------------------------------------------------------------------------------


def _is_tensor(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return value is None or isinstance(value, torch.Tensor)


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.pippy._pipe_split.default


def _cut(graph_module: fx.GraphModule, count: int) -> list[SplitStage]:
    """The stages of ``graph_module``: node i belongs to the stage after the markers before it."""
    nodes = list(graph_module.graph.nodes)
    stage_of: dict[fx.Node, int] = {}
    stage = 0
    body: list[list[fx.Node]] = [[] for _ in range(count)]
    inputs = [n for n in nodes if n.op == "placeholder" and _is_tensor(n)]
    constants = {n: n.meta.get("val") for n in nodes if n.op == "placeholder" and not _is_tensor(n)}
    output = next(n for n in nodes if n.op == "output")
    for node in nodes:
        if _is_marker(node):
            stage += 1
        elif node.op == "placeholder":
            stage_of[node] = -1  # defined before the first stage
        elif node.op not in ("get_attr", "output"):
            stage_of[node] = stage
            body[stage].append(node)
    if stage + 1 != count:
        raise SplitError(f"found {stage} cut points in the captured graph but expected {count - 1}")

    def needs(node: fx.Node, k: int, seen: set[fx.Node]) -> set[fx.Node]:
        """Tensors from before stage k that stage k needs to compute ``node``."""
        found: set[fx.Node] = set()
        for source in node.all_input_nodes:
            if source.op == "get_attr" or source in constants or source in seen:
                continue
            if stage_of[source] == k:
                continue
            if not _is_tensor(source):  # recomputed here from what it reads
                seen.add(source)
                found |= needs(source, k, seen)
            else:
                found.add(source)
        return found

    wanted: list[set[fx.Node]] = []
    for k in range(count):
        need: set[fx.Node] = set()
        for node in body[k] + ([output] if k == count - 1 else []):
            need |= needs(node, k, set())
        wanted.append(need)
    order = {node: i for i, node in enumerate(nodes)}
    # live[k]: what enters stage k (k >= 1): tensors defined before k and needed at or after k.
    live: list[list[fx.Node]] = [inputs]
    for k in range(1, count):
        values = {n for j in range(k, count) for n in wanted[j] if stage_of[n] < k}
        live.append(sorted(values, key=order.__getitem__))
    stages = []
    for k in range(count):
        last = k == count - 1
        graph = _stage_graph(body[k], live[k], None if last else live[k + 1], output if last else None, constants)
        module = SplitStage(graph_module, graph, class_name=f"Stage{k}")
        module.mode_dependent = any(_mode_dependent(n) for n in body[k])
        module.input_count = len(live[k])
        module.captured_batch_norm = any(_mode_dependent(n) and "batch_norm" in str(n.target)
                                         and len(n.args) > 5 and n.args[5] is True for n in body[k])
        stages.append(module)
    return stages


def _mode_dependent(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _MODE_OPS:
        return False
    if "dropout" in str(node.target) and len(node.args) > 1 and node.args[1] == 0.0:
        return False  # dropout with p=0 is the identity in both modes
    return True


def _stage_graph(body: list[fx.Node], inputs: list[fx.Node], outputs: Optional[list[fx.Node]],
                 output: Optional[fx.Node], constants: dict[fx.Node, Any]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def value(node: fx.Node) -> Any:
        if node in env:
            return env[node]
        if node in constants:
            return constants[node]
        if node.op == "get_attr" or not _is_tensor(node):  # parameters and recomputed sizes
            env[node] = graph.node_copy(node, value)
            return env[node]
        raise SplitError(f"internal: value {node.name} is needed before it is computed; please report this")

    for node in body:
        env[node] = graph.node_copy(node, value)
    if output is not None:
        leaves = [value(n) if isinstance(n, fx.Node) else n for n in torch.utils._pytree.tree_leaves(output.args[0])]
        graph.output(leaves[0] if len(leaves) == 1 else tuple(leaves))
    else:
        assert outputs is not None
        results = [value(n) for n in outputs]
        graph.output(results[0] if len(results) == 1 else tuple(results))
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op == "call_module" or n.is_impure())
    graph.lint()
    return graph


def _retarget_devices(stage: fx.GraphModule) -> None:
    """Points device arguments captured in the graph (``arange(device=...)``) at the stage's device."""
    device = next((t.device for t in list(stage.parameters()) + list(stage.buffers())), None)
    if device is None:
        return
    changed = False
    for node in stage.graph.nodes:
        current = node.kwargs.get("device")
        if isinstance(current, torch.device) and current != device:
            node.update_kwarg("device", device)
            changed = True
        elif node.target is torch.ops.aten.to.device and len(node.args) > 1 and node.args[1] != device:
            node.update_arg(1, device)
            changed = True
    if changed:
        stage.recompile()


# -- state-dict names --------------------------------------------------------------------------------


def _attach(stage: nn.Module, key: str, tensor: torch.Tensor) -> None:
    owner = stage
    *path, name = key.split(".")
    for atom in path:
        if not isinstance(getattr(owner, atom, None), nn.Module):
            owner.add_module(atom, nn.Module())
        owner = getattr(owner, atom)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(name, tensor)
    else:
        owner.register_buffer(name, tensor)


def _adopt_state(stage: SplitStage, model: nn.Module, aliases: dict[int, list[str]],
                 model_keys: tuple[str, ...]) -> None:
    """Records the original keys of the stage's tensors; captured constants leave the state dict."""
    stage.original_keys = {}
    stage.model_keys = model_keys
    stage.captured_training = model.training
    for name, tensor in list(stage.state_dict(keep_vars=True).items()):
        keys = aliases.get(id(tensor))
        if keys:
            stage.original_keys[name] = keys
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_path)
        owner._non_persistent_buffers_set.add(attr)  # a constant torch.export lifted out of the code
    stage.register_forward_pre_hook(_check_mode)
    stage.register_forward_pre_hook(_unpack_one_tuple)
    stage.register_forward_pre_hook(_keep_buffers_on_recompute)
    stage.register_forward_hook(_restore_buffers)


def _check_mode(stage: nn.Module, args: Any) -> None:
    if isinstance(stage, SplitStage) and stage.mode_dependent and stage.training != stage.captured_training:
        captured = "training" if stage.captured_training else "eval"
        raise RuntimeError(
            f"this split model was captured in {captured} mode and its graph has dropout or batch norm, whose "
            f"behaviour is fixed at capture; for {'eval' if stage.training is False else 'training'} split "
            f"model.{'eval' if stage.training is False else 'train'}() again with pipe.split (the stages share "
            f"the model's parameters), see {DOCS}"
        )


def _unpack_one_tuple(stage: nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
    """A stage of several inputs called with one tuple of them takes the tuple as its arguments.

    ``PipeSequential`` calls ``stage(*values)``; a runner that hands a layer
    the previous layer's tuple as one value calls ``stage(values)``. Both mean
    the same here: the inputs of a stage are tensors, never a tuple.
    """
    if len(args) == 1 and isinstance(args[0], tuple) and getattr(stage, "input_count", 1) != 1:
        return args[0]
    return None


def _keep_buffers_on_recompute(stage: nn.Module, args: Any) -> None:
    """A recomputation must not update running statistics a second time: note the buffers before it."""
    if isinstance(stage, SplitStage) and stage.mode_dependent and stage.training and is_recomputing():
        stage.__dict__["_buffers_before_recompute"] = [(b, b.detach().clone()) for b in stage.buffers()]


def _restore_buffers(stage: nn.Module, args: Any, output: Any) -> None:
    saved = stage.__dict__.pop("_buffers_before_recompute", None)
    if saved is not None:
        for buffer, value in saved:
            buffer.data.copy_(value)  # through .data: backward may have saved the buffer, keep its version


def _stage_children(container: nn.Module) -> dict[str, SplitStage]:
    return {name: child for name, child in container._modules.items() if isinstance(child, SplitStage)}


def keep_original_names(container: nn.Module) -> None:
    """Makes ``container``'s state dict use the original model's keys for the split stages among its children.

    ``container.state_dict()`` lists ``"transformer.h.0.ln_1.weight"``, not
    ``"0.transformer.h.0.ln_1.weight"``, and every key of a tied tensor once;
    ``load_state_dict`` takes the original model's checkpoints (and this
    form), filling every stage that holds a tensor. Does nothing when no child
    is a :class:`SplitStage`.
    """
    if not _stage_children(container):
        return
    container._register_state_dict_hook(_to_original_keys)
    container._register_load_state_dict_pre_hook(_from_original_keys, with_module=True)


def _to_original_keys(container: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> Any:
    stages = _stage_children(container)
    renamed: dict[str, Any] = {}
    result: "OrderedDict[str, Any]" = OrderedDict()
    placed = False
    for key, value in state.items():
        name, _, local = key[len(prefix):].partition(".") if key.startswith(prefix) else ("", "", "")
        stage = stages.get(name)
        if stage is None or local not in stage.original_keys:
            result[key] = value
            continue
        for original in stage.original_keys[local]:
            renamed.setdefault(prefix + original, value)
        if not placed:  # the renamed entries go where the first stage entry was
            result["\0stages"] = None
            placed = True
    if placed:
        order = {key: i for i, key in enumerate(next(iter(stages.values())).model_keys)}
        rank = {key: order.get(key[len(prefix):], 0) for key in renamed}
        final: "OrderedDict[str, Any]" = OrderedDict()
        for key, value in result.items():
            if key == "\0stages":
                for original in sorted(renamed, key=rank.__getitem__):
                    final[original] = renamed[original]
            else:
                final[key] = value
        result = final
    state.clear()
    state.update(result)
    return state


def _from_original_keys(container: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any,
                        strict: bool, missing: list[str], unexpected: list[str], errors: list[str]) -> None:
    stages = _stage_children(container)
    consumed: set[str] = set()
    for name, stage in stages.items():
        present = stage.state_dict(keep_vars=True)
        for local, originals in stage.original_keys.items():
            target = f"{prefix}{name}.{local}"
            if local not in present or target in state:
                continue
            source = next((prefix + key for key in originals if prefix + key in state), None)
            if source is not None:
                state[target] = state[source]
        consumed |= {prefix + key for key in stage.model_keys}
    for key in consumed:
        state.pop(key, None)
