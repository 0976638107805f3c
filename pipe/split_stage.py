"""The stages ``pipe.split`` returns: graphs over the original model's parameters, under its state-dict keys.

A :class:`SplitStage` is an ``fx.GraphModule`` cut from the exported graph
(:mod:`pipe.graph_split`). Hooks keep it honest where the capture fixed
something: the train/eval mode of dropout and batch norm (a mismatch raises),
the device arguments baked into the graph (retargeted when the stage moves),
running statistics during a recomputation (restored). A container of split
stages lists the original model's state-dict keys (:func:`keep_original_names`).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable, Optional, cast

import torch
from torch import fx, nn

from pipe.core.checkpoint import is_recomputing
from pipe.core.original_names import SOURCE

__all__: list[str] = []

DOCS = "docs/split.md"


class SplitStage(fx.GraphModule):
    """One stage of a split model: a graph over the original model's parameters.

    Attributes:
        original_keys: this stage's state-dict keys -> the original model's keys
            for the same tensor (several for tied weights).
        original_names: this stage's parameter and buffer names -> the original
            model's names for the same tensor, in the model's order (the first is
            the one ``named_parameters()`` of the model gives): the state-dict keys,
            and the non-persistent buffers (``model.rotary_emb.inv_freq``) and the
            copies of them that later stages get. A constant that ``torch.export``
            lifted out of the code has none.
        model_keys: every state-dict key of the original model, in its order.
        captured_training: the model's ``training`` flag at capture.
        mode_dependent: whether the graph has dropout or batch norm (fixed to the captured mode).
        input_count: how many tensors the stage takes.
        captured_batch_norm: whether the graph has batch norm in training mode (``deferred_batch_norm``
            cannot reach it).
        static_shapes: with ``pipe.split(..., dynamic=False)``, the shape of each input the graph was
            captured for (an input of another shape is refused); None where the sizes are dynamic.
    """

    original_keys: dict[str, list[str]]
    original_names: dict[str, list[str]]
    model_keys: tuple[str, ...]
    captured_training: bool
    mode_dependent: bool
    input_count: int
    captured_batch_norm: bool
    static_shapes: Optional[tuple[Optional[tuple[int, ...]], ...]]

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "SplitStage":
        super()._apply(fn, recurse)
        retarget_devices(self)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "SplitStage":
        """A copy that is a stage too: ``GraphModule``'s copy keeps the graph's tensors and the state-dict
        hooks only; the stage's attributes, its forward hooks and its model (copied along, sharing the
        copied tensors) are kept here."""
        name = type(self).__name__
        result = super().__deepcopy__(memo)
        for attr in _STAGE_ATTRIBUTES:
            if attr in self.__dict__:
                result.__dict__[attr] = copy.deepcopy(self.__dict__[attr], memo)
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            setattr(result, hooks, copy.copy(getattr(self, hooks)))
        type(result).__name__ = name
        return cast("SplitStage", result)  # a GraphModule to torch 2.13's types


_STAGE_ATTRIBUTES = ("original_keys", "original_names", "model_keys", "captured_training", "mode_dependent",
                     "input_count", "captured_batch_norm", "static_shapes", SOURCE)


def retarget_devices(stage: fx.GraphModule, device: Optional[torch.device] = None) -> None:
    """Points device arguments captured in the graph (``arange(device=...)``) at ``device`` (default: the
    stage's).

    Also in the graphs nested in it: torch.export puts the body of a higher-order op (``wrap_with_autocast``,
    ``wrap_with_set_grad_enabled``: a LLaMA's rotary embedding under PyTorch 2.11) in a submodule of its own,
    whose ``_assert_tensor_metadata`` would otherwise still expect the capture's device (``meta``).
    """
    if device is None:
        tensors = list(stage.parameters()) + list(stage.buffers())
        # A real device where the stage has one (a rank's materialised stage may still hold meta tensors of others).
        device = next((t.device for t in tensors if not t.is_meta), tensors[0].device if tensors else None)
    if device is None:
        return
    for module in stage.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            current = node.kwargs.get("device")
            if isinstance(current, torch.device) and current != device:
                node.update_kwarg("device", device)
                changed = True
            elif node.target is torch.ops.aten.to.device and len(node.args) > 1 and node.args[1] != device:
                node.update_arg(1, device)
                changed = True
        if changed:
            module.recompile()


def retarget_split_stages(stages: Any, device: torch.device) -> None:
    """Points the graphs of the split stages among ``stages`` at ``device`` while their tensors are still on
    ``meta`` (``DistributedPipe(init_weights=False)``; a recompile after FSDP has changed a stage's class
    recursed in fx's call wrapper)."""
    for stage in stages:
        for module in stage.modules():
            if isinstance(module, fx.GraphModule):
                retarget_devices(module, device)


# -- state-dict names --------------------------------------------------------------------------------


def attach(stage: nn.Module, key: str, tensor: torch.Tensor) -> None:
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


def adopt_state(stage: SplitStage, model: nn.Module, aliases: dict[int, list[str]],
                 model_keys: tuple[str, ...]) -> None:
    """Records the original keys and names of the stage's tensors; captured constants leave the state dict.

    The stage also keeps ``model`` (:func:`pipe.core.original_names.source_model`): a stage built on
    ``meta`` is initialised by the model's own code when a rank materialises it
    (:mod:`pipe.distributed.materialize`).
    """
    stage.original_keys = {}
    stage.original_names = {}
    stage.model_keys = model_keys
    stage.captured_training = model.training
    stage.__dict__[SOURCE] = model  # not a submodule: the stage holds only its own tensors (pipe.core.original_names)
    for name, tensor in list(stage.state_dict(keep_vars=True).items()):
        keys = aliases.get(id(tensor))
        if keys:
            stage.original_keys[name] = keys
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_path)
        owner._non_persistent_buffers_set.add(attr)  # a constant torch.export lifted out of the code
    stage.original_names = model_names(stage, model)
    stage.register_forward_pre_hook(_check_mode)
    stage.register_forward_pre_hook(_unpack_one_tuple)
    stage.register_forward_pre_hook(_check_static_shapes)  # after the unpacking: it reads the inputs one by one
    stage.register_forward_pre_hook(_keep_buffers_on_recompute)
    stage.register_forward_hook(_restore_buffers)


def model_names(stage: nn.Module, model: nn.Module) -> dict[str, list[str]]:
    """``stage``'s tensor names -> ``model``'s names for the same tensor, in ``model``'s order.

    By identity; a buffer that a later stage got as a copy (:func:`pipe.graph_split._cut`)
    is registered under the path of the model's buffer, and gets that name.
    """
    by_id: dict[int, list[str]] = {}
    buffers: set[str] = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(parameter), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(buffer), []).append(name)
        buffers.add(name)
    names: dict[str, list[str]] = {}
    held = list(stage.named_parameters(remove_duplicate=False)) + list(stage.named_buffers(remove_duplicate=False))
    for local, tensor in held:
        found = by_id.get(id(tensor)) or ([local] if local in buffers else None)
        if found:
            names[local] = found
    return names


def _check_mode(stage: nn.Module, args: Any) -> None:
    if isinstance(stage, SplitStage) and stage.mode_dependent and stage.training != stage.captured_training:
        captured = "training" if stage.captured_training else "eval"
        raise RuntimeError(
            f"this split model was captured in {captured} mode and its graph has dropout or batch norm, whose "
            f"behaviour is fixed at capture; for {'eval' if stage.training is False else 'training'} split "
            f"model.{'eval' if stage.training is False else 'train'}() again with pipe.split (the stages share "
            f"the model's parameters), see {DOCS}"
        )


def input_shapes(stage: fx.GraphModule) -> tuple[Optional[tuple[int, ...]], ...]:
    """The shape each input of ``stage``'s graph was captured at (None for an input that is no tensor); a
    graph captured with static sizes has only ints there."""
    shapes: list[Optional[tuple[int, ...]]] = []
    for node in stage.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        shapes.append(tuple(int(size) for size in value.shape) if isinstance(value, torch.Tensor) else None)
    return tuple(shapes)


def _check_static_shapes(stage: nn.Module, args: tuple[Any, ...]) -> None:
    """A stage captured at static sizes computes only inputs of those shapes: its graph holds them as constants
    (a reshape to the example's batch and length), so another shape would fail deep inside or, worse, broadcast."""
    expected = getattr(stage, "static_shapes", None)
    if expected is None:
        return
    for position, (value, shape) in enumerate(zip(args, expected)):
        if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            raise ValueError(
                f"this stage of a split model was captured at static sizes (pipe.split(..., dynamic=False)): its "
                f"input {position} must have shape {list(shape)}, got {list(value.shape)}. Give pipe.split an "
                f"example of the shape each call gets (one micro-batch: the batch divided by chunks), or split "
                f"with dynamic=True (the default) to take inputs of any size"
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

