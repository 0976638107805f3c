"""Tensor parallelism inside the graphs of ``pipe.split`` stages: Megatron's column and row splits on local shards.

torch's ``ParallelStyle``s split ``nn.Linear`` modules; a split stage has
none: ``torch.export`` flattened the model into aten ops over get-attrs of
its weights (in each outlined layer, :class:`pipe.split_blocks.SplitBlock`,
or in the stage). Here a plan by plain-model names
(``{"model.layers.*.self_attn.q_proj": ColwiseParallel(), ...}``, or
:func:`pipe.distributed.hf.tensor_parallel_plan`) is applied to that graph:

- the named module's weight becomes a ``DTensor`` on the ``"tp"`` mesh, split
  by rows (column parallel: output features) or by columns (row parallel:
  input features), as ``parallelize_module`` would make it, so that FSDP, the
  checkpoints and the optimizer see what they see for any tensor-parallel
  model;
- the ``aten.linear`` that reads it (or the ``aten.addmm`` of GPT-2's
  ``Conv1D``, whose weight is stored transposed) runs on the local shard, with
  Megatron's two collectives around the split region::

      x ─ copy (fwd: identity, bwd: all-reduce) ─ linear(x, W_rows) ─ ... ─ linear(·, W_cols) ─ reduce (fwd: all-reduce, bwd: identity) ─ + bias

- the shapes that ``torch.export`` baked into the graph (the head counts in
  ``repeat_kv``'s ``expand`` and ``reshape``: ``[b, 8, 4, s, 64]``) are rewritten
  to the local shard's, found by running the graph once on ``meta`` tensors:
  each value is compared with the shape the export recorded, which tells the
  one dimension it is split on (heads, features);
- a column layer whose output the graph splits into equal parts (GPT-2's
  ``c_attn``: q, k and v in one weight, ``split(n_embd, dim=-1)``) gives each
  rank its share of every part (``_StridedShard(dim, split_factor=parts)``:
  rank r holds q, k and v of its heads), and the split takes the local parts;
- a column layer whose output is gathered (``ColwiseParallel(output_layouts=Replicate())``)
  and a row layer whose input is whole (``RowwiseParallel(input_layouts=Replicate())``:
  each rank takes its slice of the input's features, whose gradients the backward
  gathers) split only the weights between them: the ops in between run on whole
  values on every rank. transformers' plans use them where the attention cannot
  run on a rank's heads (OLMo 2's norm over all heads' q and k; Phi-3's fused
  ``qkv_proj`` and ``gate_up_proj``).

The same run refuses what local shards cannot compute exactly, naming the op
and the fix: an op that reduces, slices or splits along the split dimension
(a fused ``qkv`` split into unequal parts, a norm over split features), a
split value that leaves the layer, a degree that does not divide a size
(heads, KV heads, features).
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any, Iterable, Mapping, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from pipe.core.original_names import source_model

__all__: list[str] = []

logger = logging.getLogger(__name__)

DOCS = "docs/huggingface.md#tensor-parallelism"

aten = torch.ops.aten

_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_BATCHED_OPS = {aten.scaled_dot_product_attention.default}  # split only along a batch dimension (batch, heads)
_MOVES_DIMS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}  # take a dim without working along it
_MATMULS = {aten.linear.default: 1, aten.addmm.default: 2}  # a layer's op -> the position of its weight
_FUSED = "pipe_tp_parts"  # node.meta key: a split that takes a fused column layer's equal parts


# -- the collectives around a split region ---------------------------------------------------------


class _CopyToSplit(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of the ranks' shards (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=_group(ctx.group_name))
        return grad, None


class _ReduceFromSplit(torch.autograd.Function):
    """Forward sums the ranks' partial outputs; the gradient is the same on every rank (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=_group(group_name))
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SliceForSplit(torch.autograd.Function):
    """Forward keeps this rank's slice of the last dimension of a whole value; backward gathers the slices'
    gradients into the whole one (the value is computed alike on every rank: each needs the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str) -> Tensor:
        group = _group(group_name)
        ctx.group_name = group_name
        width = x.shape[-1] // dist.get_world_size(group)
        return x.narrow(-1, dist.get_rank(group) * width, width).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _GatherFromSplit.apply(grad, ctx.group_name), None


class _GatherFromSplit(torch.autograd.Function):
    """Forward concatenates the ranks' slices of the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str) -> Tensor:
        group = _group(group_name)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def copy_to_split(x: Tensor, group_name: str) -> Tensor:
    """The input of a column-parallel linear (graph op)."""
    return _CopyToSplit.apply(x, group_name)


def reduce_from_split(x: Tensor, group_name: str) -> Tensor:
    """The output of a row-parallel linear (graph op)."""
    return _ReduceFromSplit.apply(x, group_name)


def gather_from_split(x: Tensor, group_name: str) -> Tensor:
    """The output of a column-parallel linear whose whole output is wanted (an LM head's logits; graph op)."""
    return _GatherFromSplit.apply(x, group_name)


def slice_for_split(x: Tensor, group_name: str) -> Tensor:
    """The whole input of a row-parallel linear, sliced to this rank's input features (graph op)."""
    return _SliceForSplit.apply(x, group_name)


def vocab_embedding(weight: Tensor, ids: Tensor, padding_idx: int, group_name: str) -> Tensor:
    """An embedding whose rows (the vocabulary) are split over the ranks (graph op): each rank looks up the ids
    in its rows, zeros for the others, and the ranks' results are summed."""
    group = _group(group_name)
    rows = weight.shape[0]
    start = dist.get_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    local_padding = padding_idx - start if start <= padding_idx < start + rows else -1
    found = aten.embedding.default(weight, (ids - start).masked_fill(outside, 0), local_padding)
    return reduce_from_split(found.masked_fill(outside.unsqueeze(-1), 0.0), group_name)


def local_shard(tensor: Tensor) -> Tensor:
    """A weight's local shard (graph op; differentiable, its gradient becomes the DTensor's)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def take_parts(whole: Tensor, parts: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s share (of ``size``) of each of the ``parts`` equal parts of ``whole``, a fused layer's bias
    (graph op: the bias stays whole on each rank, its gradient summed over them)."""
    return whole.view(parts, size, -1)[:, rank].reshape(-1)



# -- the plan ----------------------------------------------------------------------------------------


def kind_of(name: str, style: ParallelStyle) -> str:
    """What a split graph does with ``style``: ``"column"`` (``ColwiseParallel()``), ``"column gathered"``
    (``ColwiseParallel(output_layouts=Replicate())``: an LM head whose logits are gathered, or a q, k or v
    projection whose attention runs on all heads), ``"row"`` (``RowwiseParallel()``) or ``"vocabulary"``
    (``RowwiseParallel(input_layouts=Replicate())``: on an embedding its rows split; on a linear layer,
    ``"row sliced"``, its whole input sliced, as :func:`apply` finds from the op); refuses the others."""
    if type(style) is ColwiseParallel and _default(style, Replicate(), Shard(-1)):
        return "column"
    if type(style) is ColwiseParallel and _default(style, Replicate(), Replicate()):
        return "column gathered"
    if type(style) is RowwiseParallel and _default(style, Shard(-1), Replicate()):
        return "row"
    if type(style) is RowwiseParallel and _default(style, Replicate(), Replicate()):
        return "vocabulary"
    raise ValueError(
        f"tensor_parallel entry {name!r}: {type(style).__name__} with these layouts cannot apply to a stage of "
        f"pipe.split, whose tensor parallelism splits linear layers and embeddings only; use ColwiseParallel() or "
        f"RowwiseParallel() with their default layouts (no sequence parallelism, use_local_output=True), "
        f"RowwiseParallel(input_layouts=Replicate()) for an embedding or a linear layer whose input is whole, or "
        f"ColwiseParallel(output_layouts=Replicate()) for an LM head or a layer whose output is gathered, e.g. "
        f"pipe.distributed.hf.tensor_parallel_plan(model), see {DOCS}")


def _default(style: Any, input_layout: Any, output_layout: Any) -> bool:
    return (tuple(style.input_layouts) == (input_layout,) and tuple(style.output_layouts) == (output_layout,)
            and style.use_local_output)


def apply(stage: fx.GraphModule, plan: Mapping[str, ParallelStyle], mesh: DeviceMesh,
          split: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Splits the modules ``plan`` names in ``stage`` (a split stage) over ``mesh`` (its ``"tp"`` sub-mesh).

    Args:
        stage: a :class:`pipe.split_stage.SplitStage`.
        plan: module names of ``stage`` (the plain model's) -> ``ColwiseParallel()`` or ``RowwiseParallel()``.
        mesh: the one-dimensional tensor-parallel mesh.
        split: the weights split so far on this rank, ``id(weight) -> (weight, its DTensor)``: a weight tied
            between modules (an embedding and its LM head) becomes one ``DTensor``, registered wherever it is
            held (see :func:`refuse_half_split_ties`).

    A tied embedding's weight is held in the split stage under the LM head's name
    (``lm_head.weight``, read by the embedding's op): the entry for the
    embedding splits it there (:func:`_tied_uses`), and the head's entry has
    nothing to do in a stage that runs no op of the head.

    Raises:
        ValueError: a style other than those two, a module whose weight the graph does not read in one
            ``aten.linear``, a size the degree does not divide, or an op that cannot run on the shards.
    """
    size = mesh.size()
    _check_heads(stage, size)
    group_name = mesh.get_group().group_name
    graphs: dict[str, list[tuple[str, fx.Node, int]]] = {}
    tied = _tied_uses(stage)
    holders = {holder for _, holder in tied.values()}
    for name, style in plan.items():
        kind = kind_of(name, style)
        if name in tied:  # the module's op reads a weight held under another module's name
            owner, holder = "", tied[name][1]
            linear = _op_of(stage, holder, name, kind, tied[name][0])
        elif name in holders and not any(entry[0] == name for node in stage.graph.nodes
                                         for entry in (node.meta.get("nn_module_stack") or {}).values()):
            continue  # holds a tied weight for another module's op, split by that module's entry
        else:
            owner, holder = _owner(stage, name), name
            relative = name[len(owner) + 1:] if owner else name
            linear = _op_of(_graph(stage, owner), relative, name, kind)
        if kind == "vocabulary" and linear.target in _MATMULS:
            kind = "row sliced"  # RowwiseParallel(input_layouts=Replicate()) on a linear layer: its input is whole
        parts = _fused_parts(linear, name, size) if kind == "column" else 1
        graphs.setdefault(owner, []).append((kind, linear, parts))
        _shard_weights(stage.get_submodule(holder), name, kind, mesh, linear.target is aten.addmm.default, parts,
                       split)
    for owner, linears in graphs.items():
        graph_module = _graph(stage, owner)
        _rewrite(graph_module, linears, group_name, mesh.get_local_rank(), size)
        if any(kind in ("column", "row") for kind, _, _ in linears):  # else no split value leaves its op
            _localise_shapes(graph_module, size, owner or type(stage).__name__, group_name, mesh.get_local_rank())
        graph_module.recompile()
        logger.info("tensor parallel over %d ranks in %s: %d linear layers", size, owner or "the stage",
                    len(linears))


def _tied_uses(stage: fx.GraphModule) -> dict[str, tuple[fx.Node, str]]:
    """The modules that ran in ``stage``'s own graph on a weight the stage holds under another module's name:
    ``{module: (its op, the holder)}``. ``pipe.split`` keeps a tied weight once per stage, under one of its
    names (a tied LLaMA's embedding reads ``lm_head.weight``), and the module is then no module of the stage."""
    found: dict[str, tuple[fx.Node, str]] = {}
    for node in stage.graph.nodes:
        if node.op != "get_attr" or not str(node.target).endswith(".weight"):
            continue
        holder = str(node.target).rsplit(".", 1)[0]
        for user in node.users:
            stack = list((user.meta.get("nn_module_stack") or {}).values())
            if stack and stack[-1][0] != holder and not _in(stage, stack[-1][0]):
                found[stack[-1][0]] = (user, holder)
    return found


def _check_heads(stage: nn.Module, size: int) -> None:
    """Refuses a degree that does not divide the heads a HuggingFace config states."""
    config = getattr(source_model(stage), "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(
                f"tensor_parallel over {size} ranks: the model has {attr}={heads}, which {size} does not divide; "
                f"each tp rank computes whole heads: choose a tp degree that divides {attr} "
                f"({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})")


def _graph(stage: fx.GraphModule, path: str) -> fx.GraphModule:
    module = stage.get_submodule(path) if path else stage
    assert isinstance(module, fx.GraphModule)  # _owner found it so
    return module


def _owner(stage: nn.Module, name: str) -> str:
    """The path of the innermost graph (an outlined layer, or the stage: "") that runs module ``name``."""
    atoms = name.split(".")
    for end in range(len(atoms), 0, -1):  # the module itself where it was outlined (an embedding, a head)
        path = ".".join(atoms[:end])
        if isinstance(stage.get_submodule(path), fx.GraphModule):
            return path
    return ""


def _op_of(graph_module: fx.GraphModule, relative: str, name: str, kind: str,
           tied_use: Optional[fx.Node] = None) -> fx.Node:
    """The one op that reads the weight: an ``aten.linear`` (its second argument) or ``aten.addmm`` (a ``Conv1D``:
    its third), or for ``"vocabulary"`` also an ``aten.embedding`` (its first). ``tied_use``: the op of module
    ``name`` that reads the weight of ``relative``, tied to it; the weight's other users are other modules'."""
    weight = f"{relative}.weight" if relative else "weight"
    reads = [node for node in graph_module.graph.nodes if node.op == "get_attr" and node.target == weight]
    users = [user for read in reads for user in read.users if tied_use is None or user is tied_use]
    ops = {aten.embedding.default: 0, **_MATMULS} if kind == "vocabulary" else _MATMULS
    if len(users) != 1 or users[0].target not in ops or users[0].args[ops[users[0].target]] is not reads[0]:
        found = ", ".join(sorted({str(user.target) for user in users})) or "nothing"
        wanted = " or ".join(str(op) for op in ops)
        raise ValueError(
            f"tensor_parallel entry for {name!r}: the split graph reads its weight in {found}, not in one {wanted}, "
            f"so it cannot be split as {kind} (a module fused or used twice, a tied weight read by another op, or "
            f"not a linear layer); leave {name!r} out of the plan, see {DOCS}")
    if users[0].target is aten.embedding.default:
        return users[0]
    bias = _bias_of(users[0])
    if isinstance(bias, fx.Node) and len(bias.users) != 1:
        raise ValueError(f"tensor_parallel entry for {name!r}: the split graph reads its bias outside its linear "
                         f"layer, so it cannot be split; leave {name!r} out of the plan, see {DOCS}")
    return users[0]


def _bias_of(op: fx.Node) -> Any:
    """``linear(x, weight, bias)``'s bias; ``addmm(bias, x, weight)``'s first argument."""
    if op.target is aten.addmm.default:
        return op.args[0]
    return op.args[2] if len(op.args) > 2 else None


def _fused_parts(op: fx.Node, name: str, size: int) -> int:
    """Into how many equal parts the graph splits the output features of the column layer ``op`` (through
    views that keep them last): GPT-2's ``c_attn`` is q, k and v, ``split(n_embd, dim=-1)``; 1 where it does
    not. Each part is then split over the ranks on its own, and the split is marked to take local parts."""
    node = op
    features = _hint(op.meta["val"])[-1]
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target not in _SHAPE_OPS - {aten.expand.default} or _hint(user.meta["val"])[-1] != features:
            break
        node = user
    splits = [user for user in node.users if user.target is aten.split.Tensor]
    if len(node.users) != 1 or not splits:
        return 1
    split = splits[0]
    ndim = len(_hint(node.meta["val"]))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    chunk = split.args[1]
    if not isinstance(dim, int) or dim % ndim != ndim - 1 or not isinstance(chunk, int) or features % chunk:
        return 1
    if chunk % size:
        raise ValueError(
            f"tensor_parallel entry for {name!r}: its output features are {features // chunk} parts of {chunk} "
            f"(q, k, v), and {size} tensor-parallel ranks cannot split a part of {chunk} evenly; choose a tp "
            f"degree that divides {chunk} and the model's heads, see {DOCS}")
    split.meta[_FUSED] = features // chunk
    return features // chunk


def _shard_weights(module: nn.Module, name: str, kind: str, mesh: DeviceMesh, transposed: bool,
                   parts: int, split: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Splits ``module``'s weight (and a column layer's bias) over ``mesh``. A ``Conv1D`` (``transposed``)
    stores its weight as (input, output) features; a fused layer's ``parts`` are split each on its own. A weight
    in ``split`` already (tied to a module split before) gets that ``DTensor``, where it is split alike."""
    weight = module.get_parameter("weight")
    dim = 1 if kind.startswith("row") != transposed else 0
    if kind == "vocabulary":
        dim = 0
    if weight.shape[dim] % mesh.size():
        what = ("rows (vocabulary entries)" if kind == "vocabulary" else
                "input features" if kind.startswith("row") else "output features")
        raise ValueError(
            f"tensor_parallel: {name!r} has {weight.shape[dim]} {what}, which {mesh.size()} tensor-parallel ranks "
            f"cannot split evenly; choose a tp degree that divides {weight.shape[dim]} (and the model's heads and "
            f"KV heads)")

    placement = _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)
    placements: dict[str, list[Any]] = {"weight": [placement]}
    if kind.startswith("column") and parts == 1 and getattr(module, "bias", None) is not None:
        placements["bias"] = [Shard(0)]
    for attr, layout in placements.items():
        tensor = getattr(module, attr)
        if id(tensor) in split:  # tied: an embedding's rows are its head's output features, both Shard(0)
            done = split[id(tensor)][1]
            before = list(cast(DTensor, done).placements)
            if before != layout:
                raise ValueError(
                    f"tensor_parallel: the weight of {name!r} is tied to a weight already split as {before}, and "
                    f"its entry splits it as {layout}; a tied weight is one tensor: split an embedding and its LM "
                    f"head both by the vocabulary (RowwiseParallel(input_layouts=Replicate()) and "
                    f"ColwiseParallel(output_layouts=Replicate())), or leave both out of the plan")
            module.register_parameter(attr, done)
            continue
        new = nn.Parameter(distribute_tensor(tensor.data, mesh, layout), requires_grad=tensor.requires_grad)
        split[id(tensor)] = (tensor, new)
        module.register_parameter(attr, new)


def refuse_half_split_ties(partitions: Iterable[nn.Module],
                           split: Mapping[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Refuses a weight split for one module while this rank still holds it whole elsewhere (tied to it, but
    its module left out of the plan): the two would train apart. Within one graph a split weight read by an
    op the plan does not name is refused the same way.

    Raises:
        ValueError: naming the module that reads it whole and the fix.
    """
    fix = ("a tied weight is one tensor: split every module that uses it alike (an embedding and its LM head by "
           "the vocabulary: pipe.distributed.hf.tensor_parallel_plan(model, vocabulary=True)), or none")
    for partition in partitions:
        for owner, module in partition.named_modules():
            for attr, parameter in module._parameters.items():
                if parameter is not None and id(parameter) in split and split[id(parameter)][0] is parameter:
                    raise ValueError(f"tensor_parallel: {owner}.{attr} is tied to a weight the plan splits "
                                     f"elsewhere on this rank, but stays whole here; {fix}")
            if not isinstance(module, fx.GraphModule):
                continue
            for node in module.graph.nodes:
                if node.op == "get_attr":
                    try:
                        value = module.get_parameter(str(node.target))
                    except AttributeError:
                        continue
                    whole = [user for user in node.users if user.target is not local_shard]
                    if isinstance(value, DTensor) and whole:
                        raise ValueError(
                            f"tensor_parallel: {owner or 'the stage'} reads the split weight {node.target!r} "
                            f"whole in {_describe(whole[0])}; {fix}")


def _rewrite(graph_module: fx.GraphModule, linears: list[tuple[str, fx.Node, int]], group_name: str, rank: int,
             size: int) -> None:
    """Puts the collectives around the split linears and reads their weights as local shards (a fused layer's
    whole bias as this ``rank``'s parts)."""
    graph = graph_module.graph
    copies: dict[fx.Node, fx.Node] = {}

    def local(node: Optional[fx.Node]) -> Optional[fx.Node]:
        if node is None:
            return None
        with graph.inserting_after(node):
            shard = graph.call_function(local_shard, (node,))
        return shard

    def parts_of(bias: Optional[fx.Node], parts: int) -> Optional[fx.Node]:
        if bias is None:
            return None
        with graph.inserting_after(bias):
            summed = graph.call_function(copy_to_split, (bias, group_name))
        with graph.inserting_after(summed):
            taken = graph.call_function(take_parts, (summed, parts, rank, size))
        summed.meta["val"] = taken.meta["val"] = bias.meta.get("val")
        return taken

    for kind, linear, parts in linears:
        if kind == "vocabulary":  # embedding(weight, ids, padding_idx=-1, ...): the grad options change nothing
            weight, ids = linear.args[0], linear.args[1]
            padding = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("padding_idx", -1)
            assert isinstance(weight, fx.Node)
            linear.target = vocab_embedding
            linear.args, linear.kwargs = (local(weight), ids, padding, group_name), {}
            continue
        conv1d = linear.target is aten.addmm.default  # addmm(bias, x, weight): GPT-2's Conv1D
        x, weight = (linear.args[1], linear.args[2]) if conv1d else (linear.args[0], linear.args[1])
        bias = _bias_of(linear)
        assert isinstance(x, fx.Node) and isinstance(weight, fx.Node) and (bias is None or isinstance(bias, fx.Node))
        if kind.startswith("column"):
            if x not in copies:
                with graph.inserting_after(x):
                    copies[x] = graph.call_function(copy_to_split, (x, group_name))
            own_bias = parts_of(bias, parts) if parts > 1 else local(bias)
            linear.args = (own_bias, copies[x], local(weight)) if conv1d else (copies[x], local(weight), own_bias)
            if kind == "column gathered":
                with graph.inserting_after(linear):
                    gathered = graph.call_function(gather_from_split, (linear, group_name))
                linear.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
                gathered.meta["val"] = linear.meta.get("val")
            continue
        if kind == "row sliced":  # each rank takes its slice of the whole input's features
            with graph.inserting_after(x):
                x = graph.call_function(slice_for_split, (x, group_name))
        if conv1d:  # the bias is added once, after the partial products are summed
            linear.target, linear.args, linear.kwargs = aten.mm.default, (x, local(weight)), {}
        else:
            linear.args = (x, local(weight))
        with graph.inserting_after(linear):
            reduced = graph.call_function(reduce_from_split, (linear, group_name))
        last = reduced
        if bias is not None:
            with graph.inserting_after(reduced):
                last = graph.call_function(aten.add.Tensor, (reduced, bias))
        linear.replace_all_uses_with(last, delete_user_cb=lambda user: user is not reduced)
        reduced.meta["val"] = linear.meta.get("val")
        last.meta["val"] = linear.meta.get("val")
    graph.lint()


# -- the shapes on the shards -------------------------------------------------------------------------


def _hint(value: Any) -> Any:
    """A recorded value's example: an int for a SymInt, a shape for a fake tensor."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    if isinstance(value, Tensor):
        return tuple(_hint(size) if isinstance(size, torch.SymInt) else int(size) for size in value.shape)
    if isinstance(value, (tuple, list)):
        return type(value)(_hint(item) for item in value)
    return value


def _split_dim(local: tuple[int, ...], whole: tuple[int, ...], size: int) -> Optional[int]:
    """The one dimension on which ``local`` is a 1/size shard of ``whole``; None if they are equal."""
    if local == whole:
        return None
    differ = [d for d, (a, b) in enumerate(zip(local, whole)) if a != b]
    if len(local) != len(whole) or len(differ) != 1 or local[differ[0]] * size != whole[differ[0]]:
        raise _Unshardable(f"a shard of shape {list(local)} does not split {list(whole)} along one dimension "
                           f"into {size}")
    return differ[0]


class _Unshardable(Exception):
    pass


def _localise_shapes(graph_module: fx.GraphModule, size: int, where: str, group_name: str, rank: int) -> None:
    """Runs the graph on ``meta`` with local weights; rewrites baked shapes; refuses what shards cannot compute;
    gives each whole value that an op combines with split ones a gradient summed over the ranks, and each
    dropout over split values a random stream of this ``rank``'s own (:func:`rank_random`)."""
    env: dict[fx.Node, Any] = {}
    split: dict[fx.Node, Optional[int]] = {}  # value -> the dimension it is split on
    whole_into_split: dict[fx.Node, list[fx.Node]] = {}  # a whole value -> the ops that combine it with split ones
    dropping: list[fx.Node] = []  # dropout over split values
    for node in graph_module.graph.nodes:
        if node.op == "output":
            for source in node.all_input_nodes:
                if split.get(source) is not None:
                    raise ValueError(
                        f"tensor_parallel in {where}: {source.name} leaves the layer split across the tp ranks; "
                        f"end each split region with a RowwiseParallel module (o_proj, down_proj), see {DOCS}")
            break
        try:
            env[node], split[node] = _run(graph_module, node, env, split, size)
        except _Unshardable as reason:
            raise ValueError(
                f"tensor_parallel in {where}: {_describe(node)} cannot run on shards split {size} ways: {reason}; "
                f"leave the modules before it out of the plan, or choose a tp degree that divides the model's "
                f"heads, KV heads and features, see {DOCS}") from None
        if node.op == "call_function" and any(split.get(source) is not None for source in node.all_input_nodes):
            if _drops(node):
                dropping.append(node)
            for source in node.all_input_nodes:
                if split.get(source) is None and isinstance(env.get(source), Tensor) \
                        and source.target is not local_shard:
                    whole_into_split.setdefault(source, []).append(node)
    # Each rank's gradient of such a value (Qwen3's q_norm weight, applied to the rank's heads) is its part of
    # the whole: summed over the ranks in the backward, as Megatron's copy does for a column split's input.
    graph = graph_module.graph
    for source, users in whole_into_split.items():
        with graph.inserting_after(source):
            copied = graph.call_function(copy_to_split, (source, group_name))
        for user in users:
            user.replace_input_with(source, copied)
    for node in dropping:  # each rank's heads their own masks, as Megatron's model-parallel random stream gives
        op: Any = node.target
        node.args, node.target = (op, rank, *node.args), rank_random


def _drops(node: fx.Node) -> bool:
    """Whether ``node`` draws a dropout mask: ``aten.dropout``/``native_dropout`` or attention with
    ``dropout_p``, at a rate that is not 0 (a number) or that follows the mode (a node)."""
    if node.target is aten.scaled_dot_product_attention.default:
        rate = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    elif node.target in (aten.dropout.default, aten.native_dropout.default):
        rate = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
    else:
        return False
    return isinstance(rate, fx.Node) or bool(rate)


def rank_random(op: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
    """``op`` (a dropout over values split across the tp ranks) drawing from a random stream of this ``rank``'s
    own: seeded by a number drawn from the global stream (the same on every rank, and drawn again alike when a
    checkpointed forward is recomputed) plus the rank; the global stream is then as if ``op`` had not run.
    Graph op: each rank's heads get their own masks, where the same masks would repeat over the ranks."""
    tensor = next(arg for arg in args if isinstance(arg, Tensor))
    seed = int(torch.randint(0, 2 ** 62, ()).item())
    devices = [tensor.device] if tensor.device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=tensor.device.type if devices else "cuda"):
        torch.manual_seed(seed + rank)
        return op(*args, **kwargs)


def _describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else ""
    return f"op {node.target} ({node.name}{' in ' + module if module else ''})"


def _run(graph_module: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], split: dict[fx.Node, Optional[int]],
         size: int) -> tuple[Any, Optional[int]]:
    recorded = _hint(node.meta.get("val"))
    if node.op == "placeholder":
        return _meta_like(node), None
    if node.op == "get_attr":
        tensor = operator.attrgetter(str(node.target))(graph_module)
        if isinstance(tensor, Tensor):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return torch.empty(local.shape, dtype=local.dtype, device="meta"), None
        return tensor, None
    inputs = node.all_input_nodes
    split_inputs = {source: split[source] for source in inputs if split.get(source) is not None}
    if node.op == "call_module":
        if split_inputs:
            raise _Unshardable(f"{node.target} gets a split value")
        return _meta_like(node), None
    if node.target is local_shard:
        return env[inputs[0]], None
    if node.target is take_parts:  # a shard, as local_shard's: the ops that read it are split by their shapes
        return node.target(*fx.node.map_arg(node.args, env.__getitem__)), None
    if node.target in (copy_to_split, reduce_from_split):
        return env[inputs[0]], None
    if node.target in (gather_from_split, vocab_embedding):  # whole results, made by collectives
        return _meta_like(node), None
    if node.target is slice_for_split:  # this rank's slice of a whole value's last dimension
        whole = env[inputs[0]]
        return torch.empty((*whole.shape[:-1], whole.shape[-1] // size), dtype=whole.dtype, device="meta"), \
            whole.dim() - 1
    first_split = split.get(inputs[0]) if inputs else None
    if node.target in _SHAPE_OPS and first_split is not None:
        _localise_shape_arg(node, first_split, size)
    if node.meta.get(_FUSED) and first_split is not None:  # q, k, v of a fused layer: each rank's parts
        chunk = node.args[1]
        assert isinstance(chunk, int)  # _fused_parts marked it so
        node.args = (node.args[0], chunk // size, *node.args[2:])
    elif split_inputs:
        _refuse_along(node, {source: dim for source, dim in split_inputs.items() if dim is not None}, env)
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    target: Any = node.target
    try:
        value = target(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError) as error:
        if not split_inputs and not _reads_shard(node):
            raise
        raise _Unshardable(str(error).splitlines()[0]) from None
    if value is None:  # a check (_assert_tensor_metadata: dtype, device, layout; not the shape)
        return None, None
    if not isinstance(value, Tensor):
        if split_inputs and not isinstance(value, (tuple, list)):
            raise _Unshardable("it turns a split value into a number")
        if isinstance(value, (tuple, list)):
            dims = {_split_dim(tuple(item.shape), tuple(whole), size)
                    for item, whole in zip(value, recorded) if isinstance(item, Tensor)}
            if split_inputs and None in dims:
                raise _Unshardable("a part of its result is not split as its input was")
            return value, next(iter(dims), None) if len(dims) == 1 else None
        return value, None
    dim = _split_dim(tuple(value.shape), tuple(recorded), size)
    partial = bool(node.users) and all(user.target is reduce_from_split for user in node.users)  # a row split
    if dim is None and (split_inputs or _reads_shard(node)) and not partial:
        raise _Unshardable("it combines the split dimension into a whole result, which needs the other ranks' "
                           "parts")
    if dim is not None and not split_inputs and not _reads_shard(node):
        raise _Unshardable("its result is split though nothing it reads is")
    return value, dim


def _reads_shard(node: fx.Node) -> bool:
    return any(source.target in (local_shard, take_parts) for source in node.all_input_nodes)


def _meta_like(node: fx.Node) -> Any:
    """A ``meta`` tensor of the shape and dtype ``node``'s value was recorded with (a stage's token ids stay
    integers); another recorded value as it is."""
    value = node.meta.get("val")
    recorded = _hint(value)
    if isinstance(recorded, tuple) and all(isinstance(size, int) for size in recorded):
        return torch.empty(recorded, dtype=value.dtype if isinstance(value, Tensor) else None, device="meta")
    return recorded


def _localise_shape_arg(node: fx.Node, dim: int, size: int) -> None:
    """Rewrites the size a view, reshape or expand gives the split dimension to the shard's."""
    source = node.all_input_nodes[0]
    whole_in = _hint(source.meta["val"])
    whole_out = _hint(node.meta["val"])
    if node.target is aten.expand.default:
        target = dim + len(whole_out) - len(whole_in)
    else:
        before = math.prod(whole_in[:dim])
        target = next((d for d in range(len(whole_out))
                       if math.prod(whole_out[:d]) == before and whole_out[d] != 1), -1)
        if target < 0:
            raise _Unshardable(f"it reshapes {list(whole_in)} to {list(whole_out)} across the split dimension {dim}")
    if whole_out[target] % size:
        raise _Unshardable(f"its dimension {target} of size {whole_out[target]} (e.g. heads) is not divisible by "
                           f"{size}")
    shape = list(node.args[1])  # type: ignore[arg-type]
    entry = shape[target]
    if isinstance(entry, int) and entry != -1:
        shape[target] = entry // size
        node.args = (node.args[0], shape, *node.args[2:])
    elif isinstance(entry, fx.Node):
        raise _Unshardable(f"its dimension {target} has a size computed at run time ({entry.name})")


def _refuse_along(node: fx.Node, split_inputs: Mapping[fx.Node, int], env: Mapping[fx.Node, Any]) -> None:
    """Refuses an op that reduces, slices, splits or attends along a split dimension."""
    head: Any = node.args[0] if node.args else None
    if isinstance(head, (list, tuple)):  # cat, stack: a list of tensors and a dim
        head = next((item for item in head if isinstance(item, fx.Node)), None)
    if not isinstance(head, fx.Node):
        return
    first: fx.Node = head
    dim = split_inputs.get(first)
    if node.target in _BATCHED_OPS:
        ndim = len(env[first].shape)
        if any(d >= ndim - 2 for d in split_inputs.values()):
            raise _Unshardable("attention splits along the batch or heads dimension only")
        return
    schema = getattr(node.target, "_schema", None)
    if dim is None or schema is None or node.target in _MOVES_DIMS:
        return
    ndim = len(env[first].shape)
    if node.target is aten.slice.Tensor and _whole_slice(node, first, dim):
        return
    for position, argument in enumerate(schema.arguments):
        if argument.name != "dim":
            continue
        given = node.args[position] if position < len(node.args) else node.kwargs.get("dim", argument.default_value)
        dims = given if isinstance(given, (list, tuple)) else [given]
        if given is None or any(isinstance(d, int) and d % ndim == dim for d in dims):
            raise _Unshardable(f"it works along dimension {dim}, the one split across the tp ranks")


def _whole_slice(node: fx.Node, source: fx.Node, dim: int) -> bool:
    """A slice that keeps the whole of the split dimension (``x[:, :, None]`` records ``slice(x, 1, 0, 2**63-1)``)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= _hint(source.meta["val"])[dim])) \
        and step in (None, 1)


# -- which entries a stage's graphs hold -----------------------------------------------------------


def plain_modules(partition: nn.Module) -> list[str]:
    """The plain model's names of the modules that the split stages among ``partition``'s children hold or run
    (a split stage's modules carry the plain model's names; a tied embedding runs on its head's weight)."""
    found = []
    for child in partition.children():
        if _is_split_stage(child):
            found += [name for name, _ in child.named_modules() if name] + list(_tied_uses(cast(fx.GraphModule, child)))
    return found


def apply_to_partition(partition: nn.Module, plan: Mapping[str, ParallelStyle], mesh: DeviceMesh,
                       split: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """:func:`apply` for each split stage among ``partition``'s children, with the entries that fall in it."""
    for child in partition.children():
        if isinstance(child, fx.GraphModule) and _is_split_stage(child):
            tied = _tied_uses(child)
            own = {name: style for name, style in plan.items() if _in(child, name) or name in tied}
            if own:
                apply(child, own, mesh, split)


def _is_split_stage(module: nn.Module) -> bool:
    """A stage of ``pipe.split``: a graph that knows the model it was cut from (this runner-level module does
    not import the front end's class)."""
    return isinstance(module, fx.GraphModule) and source_model(module) is not None


def _in(stage: nn.Module, name: str) -> bool:
    try:
        stage.get_submodule(name)
    except AttributeError:
        return False
    return True
