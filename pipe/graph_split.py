"""``pipe.split``: cut any ``nn.Module`` at named submodules into stages that pass values positionally.

``Pipe`` and ``DistributedPipe`` run a sequence of layers. Most models are not
one: a transformer's blocks need the attention mask and the position
embeddings made at the top, the LM head reuses the embedding's weight. Rather
than have users write adapter layers, ``split`` captures the model's forward
as one graph with ``torch.export`` (PyTorch's own capture, as
``torch.distributed.pipelining.pipeline`` does; the cut points are the same
``pipe_split`` markers), and cuts the graph before each named submodule::

    graph:   embed ─ block0 ─┊─ block1 ─ norm ─ head        at=["h.1"]
    stages:  Stage0(ids, mask) -> (mask, hidden)  │  Stage1(mask, hidden) -> logits

Every value a later stage needs crosses each boundary in between (a stage
passes through what it does not use), as a tuple: the calling convention of
:class:`pipe.PipeSequential`, which ``split`` returns. Sizes and other
non-tensor values are recomputed where they are needed, so only tensors
cross; so are tensors made from the integer inputs and constant buffers alone
by pure ops (the mask expanded to ``[b, 1, s, s]``, made again from ``mask``
in Stage1; LLaMA's rotary tables, from ``inv_freq``). Each
stage is an ``fx.GraphModule`` whose parameters are the original model's
parameter objects under their original paths; ``state_dict()`` of the
result (and of a ``Pipe`` or ``DistributedPipe`` around it) has the original
model's keys (:func:`keep_original_names`), tied weights included.

What cannot be split: see docs/split.md (data-dependent control flow, calls
of a cut module more than once, train/eval switches after capture).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import warnings
from types import MethodType
from typing import Any, Callable, Collection, ContextManager, Optional, Sequence, Union, cast

import torch
from torch import fx, nn
from torch.export import Dim, ShapesCollection

from pipe.core.sequential import PipeSequential
from pipe.split_blocks import other_holders, outline_layers, repeated_layers
from pipe.split_repeat import capture as repeated
from pipe.split_stage import DOCS, SplitStage, adopt_state, attach, input_shapes, keep_original_names

__all__: list[str] = []

logger = logging.getLogger(__name__)

# Ops whose result depends on train/eval mode, baked into the graph at capture.
_MODE_OPS = {
    torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default, torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default, torch.ops.aten.batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten.cudnn_batch_norm.default, torch.ops.aten.native_batch_norm.default,
}


class SplitError(RuntimeError):
    """The model cannot be captured as one graph, or a cut point cannot be used."""


def split(
    model: nn.Module,
    example_args: Any,
    example_kwargs: Optional[dict[str, Any]] = None,
    *,
    at: Union[Sequence[str], str],
    stages: Optional[int] = None,
    repeat: bool = True,
    dynamic: bool = True,
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
            Use a batch of at least 2 rows (dim 0; a batch of 1 is refused) and
            the sizes you will train with; every dimension is captured as
            dynamic where the model allows it. Beside a model on ``meta``
            they may be on the CPU: only their shapes and dtypes are captured.
        example_kwargs: keyword inputs. Tensors among them become inputs of
            the split model; other values (``use_cache=False``) are fixed.
        at: module paths, e.g. ``["transformer.h.2"]``: a new stage begins
            where each of these modules is called. Each must run exactly once
            per forward. ``"auto"`` with ``stages=N``: cut before layers of the
            model's ``nn.ModuleList`` (its decoder layers) into N stages whose
            largest forward FLOPs on the example batch are smallest, the
            embedding counted with the first layer and the head with the last
            (:mod:`pipe.balance.flops`; every rank computes the same cut, on
            ``meta`` too). ``"layers"``: cut before every such layer and before
            the first module with parameters after them (the final norm), so
            the embedding, each layer and the norm with the head are pieces of
            their own, for :func:`pipe.plan.plan` (or ``balance=``) to group
            into stages by measured cost.
        stages: with ``at="auto"``, how many stages (``at="layers"``: one per layer, plus two).
        repeat: capture two of the model's alike layers and repeat the
            second's graph for the others (:mod:`pipe.split_repeat`: the same
            graph, in a fraction of the time). ``False`` exports every layer:
            for a forward that branches on a layer's index in Python without
            the layers differing in their settings.
        dynamic: capture every dimension as dynamic where the model allows
            it (the default), so the stages take inputs of other sizes than
            the example's. ``False`` captures the example's sizes as they are,
            in half the time or less (``torch.export`` then reasons about no
            symbolic sizes): for training at one shape. Give the shape each
            stage will be called with, one micro-batch (the batch divided by
            ``chunks``); a batch of 1 row is allowed. Each stage then refuses
            an input of another shape, naming it.

    Returns:
        A ``PipeSequential`` of ``len(at) + 1`` stages. It takes the tensor
        inputs positionally, ``example_args`` first, then the tensors of
        ``example_kwargs`` in their order, and returns the model's output
        tensor (or a tuple of its output tensors, flattened). Parameters are
        the model's own objects: training either trains both.

    Raises:
        ValueError, TypeError: bad ``at`` or ``stages``, or example inputs (an example batch of 1 row, unless
            ``dynamic=False``).
        SplitError: the model cannot be captured as one graph (for example
            data-dependent control flow), see docs/split.md.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"pipe.split takes an nn.Module, got {type(model).__name__}")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs or None, got {type(example_kwargs).__name__}")
    if not isinstance(dynamic, bool):
        raise TypeError(f"pipe.split: dynamic must be True or False, got {dynamic!r}")
    if dynamic:
        _refuse_batch_of_one(example_args, example_kwargs or {})
    example_args, example_kwargs = _examples_on_meta(model, example_args, example_kwargs)
    if isinstance(at, str):
        at = _auto_points(model, example_args, example_kwargs or {}, at, stages)
    elif stages is not None:
        raise ValueError(f"pipe.split: stages={stages!r} goes with at='auto'; with at={list(at)!r} the stages are "
                         f"len(at) + 1 = {len(at) + 1}: leave stages out")
    points = _verify_points(model, at)
    if not isinstance(repeat, bool):
        raise TypeError(f"pipe.split: repeat must be True or False, got {repeat!r}")
    export = functools.partial(_export, dynamic=dynamic)
    graph_module = repeated(model, example_args, example_kwargs or {}, points, export) if repeat else None
    if graph_module is None:
        graph_module = export(model, example_args, example_kwargs or {}, points).module()
    model_state = model.state_dict(keep_vars=True)
    pieces = _cut(graph_module, len(points) + 1, {id(t) for t in model_state.values()})
    aliases: dict[int, list[str]] = {}
    for key, tensor in model_state.items():
        aliases.setdefault(id(tensor), []).append(key)
    used = {id(t) for stage in pieces for t in stage.state_dict(keep_vars=True).values()}
    unused = [key for key, tensor in model_state.items() if id(tensor) not in used and aliases[id(tensor)][0] == key]
    for key in unused:  # kept, in the first stage, so that checkpoints still hold every key
        attach(pieces[0], key, model_state[key])
    if unused:
        logger.info("pipe.split: forward does not use %s; the first stage keeps them for the state dict", unused[:8])
    for stage in pieces:
        stage.static_shapes = None if dynamic else input_shapes(stage)
        adopt_state(stage, model, aliases, tuple(model_state))
        outline_layers(stage, model)
        if model.training:
            _dropout_follows_mode(stage)
    result = PipeSequential(*pieces)
    result.train(model.training)
    keep_original_names(result)
    logger.info("pipe.split: %s cut at %s into %d stages", type(model).__name__, list(points), len(pieces))
    return result


def _auto_points(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], at: str,
                 stages: Optional[int]) -> list[str]:
    if at not in ("auto", "layers"):
        raise TypeError(f"at must be a list of module paths such as ['transformer.h.2'], 'auto' with stages=N, or "
                        f"'layers', got {at!r}")
    if at == "layers" and stages is not None:
        raise ValueError(f"pipe.split(at='layers') cuts before every layer, so it takes no stages= (got "
                         f"stages={stages!r}); leave it out, or pass at='auto', stages={stages!r}")
    layers = repeated_layers(model)
    if not layers:
        raise ValueError(f"pipe.split(at={at!r}): {type(model).__name__} has no nn.ModuleList of layers to cut "
                         f"between; give the cut by name, at=[...]")
    if at == "layers":
        return layers + _after_layers(model, layers)[:1]
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 2:
        raise ValueError(f"pipe.split(at='auto') needs stages=N, an int >= 2 (how many stages to cut into), got "
                         f"stages={stages!r}")
    from pipe.balance.flops import auto_cut

    return auto_cut(model, args, kwargs, stages, layers)


def _after_layers(model: nn.Module, layers: list[str]) -> list[str]:
    """The modules with parameters of their own registered after the last of ``layers`` (a decoder's final norm,
    then its head), in the model's order."""
    order = [name for name, _ in model.named_modules()]
    last = order.index(layers[-1])
    return [name for name in other_holders(model, layers) if order.index(name) > last]


# -- example inputs --------------------------------------------------------------------------------


def _refuse_batch_of_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuses an example whose batch (dim 0 of its tensor inputs) is 1: the capture would fix it at 1.

    ``torch.export`` specialises a dimension whose example size is 1 even where
    it is marked dynamic, so the split model would refuse every micro-batch of
    another size, at its first step, in its first stage (while the next stage
    waits for it). Captured at 2 rows, the batch stays dynamic where the model
    allows it, and micro-batches of 1 run too (LLaMA's and GPT-2's do). Every
    tensor input with a dimension is split on dim 0 into micro-batches, so dim
    0 is the batch; 0-d tensors have none. Only when every such input has one
    row is the batch 1: a tensor of one row beside a batch of more is one that
    is not split (a ``pipe.NoChunk``), and keeps its size.
    """
    named = [(f"example_args[{i}]", leaf) for i, value in enumerate(args)
             for leaf in torch.utils._pytree.tree_leaves(value)]
    named += [(f"example_kwargs[{key!r}]", leaf) for key, value in kwargs.items()
              for leaf in torch.utils._pytree.tree_leaves(value)]
    batched = [(name, leaf) for name, leaf in named if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not batched or any(leaf.size(0) != 1 for _, leaf in batched):
        return
    name, first = batched[0]
    sizes = ", ".join(str(size) for size in (2, *first.shape[1:]))
    device = "" if first.device.type == "cpu" else f", device={str(first.device)!r}"
    raise ValueError(
        f"pipe.split: the example batch has 1 row ({name} has shape {list(first.shape)}); torch.export fixes a "
        f"dimension of size 1, so every micro-batch of another size would fail in the first stage at the first "
        f"step. Give an example batch of at least 2 rows, e.g. torch.zeros({sizes}, dtype={first.dtype}{device}) "
        f"(the batch then stays dynamic where the model allows it, micro-batches of 1 included)"
    )


def _examples_on_meta(model: nn.Module, args: tuple[Any, ...],
                      kwargs: Optional[dict[str, Any]]) -> tuple[tuple[Any, ...], Optional[dict[str, Any]]]:
    """The example inputs on ``meta`` when the whole model is there (built under ``torch.device("meta")``).

    Only their shapes and dtypes matter to the capture. CPU examples beside a
    ``meta`` model fail in ``torch.export``: always on torch 2.11 ("found two
    different devices meta, cpu"), on 2.13 where the forward combines an input
    with a tensor computed from the weights (a hidden state times a mask). A
    stage's graph follows the device of its weights when it runs
    (:mod:`pipe.split_stage`), so the capture's device does not stay in it.
    """
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if not tensors or not all(t.is_meta for t in tensors):
        return args, kwargs

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not value.is_meta:
            return value.detach().to("meta").requires_grad_(value.requires_grad)
        return value

    args = torch.utils._pytree.tree_map(to_meta, args)
    if kwargs is not None:
        kwargs = torch.utils._pytree.tree_map(to_meta, kwargs)
    return args, kwargs


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
            points: list[str], dynamic: bool = True) -> torch.export.ExportedProgram:
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
            shapes[leaf] = (Dim.AUTO if dynamic else Dim.STATIC,) * leaf.dim()
    try:
        for path in points:
            module = model.get_submodule(path)
            saved.append((module, module.__dict__.get("forward")))
            module.forward = marked(path, module)
        try:
            with _without_code():
                program = torch.export.export(model, args, kwargs,
                                              dynamic_shapes=shapes.dynamic_shapes(model, args, kwargs))
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


def _without_code() -> ContextManager[Any]:
    """While ``torch.export`` runs, its intermediate graph modules write their Python code only when called.

    The export builds and rewrites graph modules several times (tracing, functionalisation, lifting the
    parameters), and each writes the Python of its graph at once: a fifth to a quarter of a 0.5B LLaMA's split in
    one process. Only the final graph is used here, and ``program.module()`` (run outside
    this) writes that one's code. torch's compiler defers the code the same way; where its private switch is
    missing, nothing changes but the time.
    """
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - a torch without it
        return contextlib.nullcontext()
    return cast(ContextManager[Any], _use_lazy_graph_module(True))


# -- cutting the graph ------------------------------------------------------------------------------


def _is_tensor(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return value is None or isinstance(value, torch.Tensor)


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.pippy._pipe_split.default


def _cut(graph_module: fx.GraphModule, count: int, saved: Collection[int] = ()) -> list[SplitStage]:
    """The stages of ``graph_module``: node i belongs to the stage after the markers before it.

    ``saved``: the ids of the model's state-dict tensors (a buffer outside it may be copied into a stage).
    """
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

    recomputed: set[fx.Node] = set()  # tensors made again where needed instead of crossing (grows below)

    def needs(node: fx.Node, k: int, seen: set[fx.Node]) -> set[fx.Node]:
        """Tensors from before stage k that stage k needs to compute ``node``."""
        found: set[fx.Node] = set()
        for source in node.all_input_nodes:
            if source.op == "get_attr" or source in constants or source in seen:
                continue
            if stage_of[source] == k:
                continue
            if not _is_tensor(source) or source in recomputed:  # recomputed here from what it reads
                seen.add(source)
                found |= needs(source, k, seen)
            else:
                found.add(source)
        return found

    order = {node: i for i, node in enumerate(nodes)}

    def crossing() -> tuple[list[set[fx.Node]], list[list[fx.Node]]]:
        """``wanted[k]``: tensors from before stage k that it needs; ``live[k]``: what enters stage k
        (k >= 1): tensors defined before k and needed at or after k."""
        wanted: list[set[fx.Node]] = []
        for k in range(count):
            need: set[fx.Node] = set()
            for node in body[k] + ([output] if k == count - 1 else []):
                need |= needs(node, k, set())
            wanted.append(need)
        live: list[list[fx.Node]] = [inputs]
        for k in range(1, count):
            values = {n for j in range(k, count) for n in wanted[j] if stage_of[n] < k}
            live.append(sorted(values, key=order.__getitem__))
        return wanted, live

    wanted, live = crossing()
    # A tensor made from the inputs alone by pure ops (an attention mask expanded to [b, 1, s, s]) is made
    # again in each stage that needs it, where the inputs it is made from enter that stage anyway: a
    # message without it is smaller (s x s bytes per sample for a mask), for a few cheap ops.
    # So is one made from those inputs and constant buffers (LLaMA's rotary cos and sin from inv_freq): a
    # buffer outside the state dict that nothing writes and that needs no gradient. A later stage gets its own
    # copy of the buffer (a buffer shared by stages of two ranks would be a tie, which buffers cannot be).
    def constant(node: fx.Node) -> bool:
        try:
            tensor = graph_module.get_buffer(str(node.target))
        except AttributeError:
            return False
        return (not tensor.requires_grad and id(tensor) not in saved
                and not any(_writes(user) for user in node.users))

    made_again = []
    for value in sorted({n for k in range(1, count) for n in wanted[k] if 0 <= stage_of[n] < k}, key=order.__getitem__):
        cone = _input_cone(value, constants, constant)
        if cone is not None and all(cone[0] <= set(live[k]) for k in range(stage_of[value] + 1, count)
                                    if value in live[k]):
            recomputed |= {value, *cone[1]}
            made_again.append(value.name)
    if made_again:
        wanted, live = crossing()
        logger.info("pipe.split: %s, made from the inputs and constant buffers alone, are made again in the "
                    "stages that need them instead of crossing stages", made_again)
    stages = []
    for k in range(count):
        last = k == count - 1
        graph = _stage_graph(body[k], live[k], None if last else live[k + 1], output if last else None, constants,
                             recomputed)
        module = SplitStage(graph_module, graph, class_name=f"Stage{k}")
        module.mode_dependent = any(_mode_dependent(n) for n in body[k])
        module.input_count = len(live[k])
        module.captured_batch_norm = any(_mode_dependent(n) and "batch_norm" in str(n.target)
                                         and len(n.args) > 5 and n.args[5] is True for n in body[k])
        stages.append(module)
    for target in sorted({str(n.target) for n in recomputed if n.op == "get_attr"}):
        using = [m for m in stages if any(n.op == "get_attr" and n.target == target for n in m.graph.nodes)]
        for module in using[1:]:  # the first stage keeps the model's tensor, later ones a copy
            owner_path, _, name = target.rpartition(".")
            owner = module.get_submodule(owner_path)
            owner.register_buffer(name, owner.get_buffer(name).clone(), persistent=False)
    return stages


def _mode_dependent(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is _ATTENTION:
        return isinstance(_attention_dropout(node), float) and _attention_dropout(node) > 0  # a number: fixed
    if node.op != "call_function" or node.target not in _MODE_OPS:
        return False
    if "dropout" in str(node.target) and len(node.args) > 1 and node.args[1] == 0.0:
        return False  # dropout with p=0 is the identity in both modes
    if node.target is torch.ops.aten.dropout.default and len(node.args) > 2 and isinstance(node.args[2], fx.Node):
        return False  # follows the module's mode (_dropout_follows_mode)
    return True


_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def _attention_dropout(node: fx.Node) -> Any:
    """``scaled_dot_product_attention``'s ``dropout_p``: a number captured, or a node."""
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)


def _dropout_follows_mode(stage: fx.GraphModule) -> None:
    """Makes the dropout that a capture in training mode baked into ``stage``'s graphs follow each module's
    ``training`` flag, as the model's own modules do: ``aten.dropout(x, p, True)`` takes the flag as its
    ``train`` argument, and ``scaled_dot_product_attention``'s ``dropout_p`` becomes ``p`` in training, 0 in
    eval (HF passes ``dropout=0.0 if not self.training``). Then ``eval()`` and ``eval_step`` evaluate without
    dropout, where they were refused (dropout in the residual stream) or, for attention dropout alone, silently
    kept it. The stage's ``mode_dependent`` is what is left: batch norm."""
    graphs = [module for module in stage.modules() if isinstance(module, fx.GraphModule)]
    for graph_module in graphs:
        graph = graph_module.graph
        nodes = [n for n in graph.nodes if n.op == "call_function" and (
            (n.target is torch.ops.aten.dropout.default and len(n.args) > 2 and n.args[2] is True and n.args[1] > 0)
            or (n.target is _ATTENTION and isinstance(_attention_dropout(n), float) and _attention_dropout(n) > 0))]
        if not nodes:
            continue
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1:]
        with graph.inserting_after(last_input[0]) if last_input else graph.inserting_before(next(iter(graph.nodes))), \
                warnings.catch_warnings():
            # fx expects a get_attr to name a tensor or a module; the module's flag reads as well (self.training)
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node", category=UserWarning)
            training = graph.get_attr("training")
        for node in nodes:
            if node.target is _ATTENTION:
                p = _attention_dropout(node)
                with graph.inserting_before(node):
                    scaled = graph.call_function(operator.mul, (p, training))  # p in training, 0.0 in eval
                if len(node.args) > 4:
                    node.args = (*node.args[:4], scaled, *node.args[5:])
                else:
                    node.kwargs = {**node.kwargs, "dropout_p": scaled}
            else:
                node.args = (node.args[0], node.args[1], training)
        graph_module.recompile()
        logger.debug("pipe.split: %d dropout ops of %s follow its train/eval mode", len(nodes),
                     type(graph_module).__name__)
    stage.mode_dependent = any(_mode_dependent(n) for g in graphs for n in g.graph.nodes)  # type: ignore[assignment]


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` may write to its arguments: an op whose schema says so (in-place, out=), or one
    without a schema (a module, a higher-order op). Checks such as ``_assert_tensor_metadata`` do not."""
    schema = getattr(node.target, "_schema", None)
    return node.op != "call_function" or schema is None or schema.is_mutable


def _input_cone(value: fx.Node, constants: dict[fx.Node, Any], constant: Callable[[fx.Node], bool] = lambda n: False
                ) -> Optional[tuple[set[fx.Node], set[fx.Node]]]:
    """``(inputs, nodes)`` when ``value`` is made from the graph's integer or boolean inputs and ``constant``
    buffers alone by ops that neither draw random numbers nor depend on the mode or on parameters and other
    buffers: the inputs it reads and the nodes in between (the buffers' included); None otherwise."""
    inputs: set[fx.Node] = set()
    between: set[fx.Node] = set()
    stack, seen = [value], {value}
    while stack:
        node = stack.pop()
        if node.op == "get_attr":
            if not constant(node):
                return None  # parameters, and buffers that are saved, written or trained
            between.add(node)
            continue
        if node.op == "placeholder":
            if node in constants:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.is_complex():
                return None  # a float input may need a gradient: it crosses as itself
            inputs.add(node)
            continue
        if node.op != "call_function" or node.target in _MODE_OPS or _is_marker(node) or node.is_impure() \
                or any(word in str(node.target) for word in ("rand", "bernoulli", "normal", "dropout")):
            return None  # parameters, buffers, modules, random or mode-dependent ops
        if _is_tensor(node):
            between.add(node)
        for source in node.all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    between.discard(value)
    return inputs, between


def _stage_graph(body: list[fx.Node], inputs: list[fx.Node], outputs: Optional[list[fx.Node]],
                 output: Optional[fx.Node], constants: dict[fx.Node, Any],
                 recomputed: Collection[fx.Node] = ()) -> fx.Graph:
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
        if node.op == "get_attr" or not _is_tensor(node) or node in recomputed:  # parameters, sizes, masks
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


