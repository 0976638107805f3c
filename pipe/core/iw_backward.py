"""The I/W backward: the input gradient now (I), the weight gradient later (W), one graph for both.

Zero-bubble schedules (:mod:`pipe.core.zero_bubble`) send a stage's input
gradient upstream as soon as they can and compute its weight gradient later.
Both halves walk the same autograd graph: the one the forward built, or, for
a checkpointed cell, the one its single recomputation built. Nothing re-runs
the forward for W; that is what lets recomputation and zero bubble compose
(a checkpoint that recomputes on every walk of the graph, as
``torch.utils.checkpoint`` does, would run once for I and again for each W call).

I computes only what the input gradients need: ``torch.autograd.grad`` from the
outputs to the inputs, the graph retained. On the way it records the gradient
arriving at each *branch node*: a node on the path from outputs to inputs from
which a parameter hangs off that path (``AddmmBackward`` for a ``Linear``'s
weight and bias, ``NativeLayerNormBackward`` for a ``LayerNorm``'s)::

    outputs ── ... ── Addmm ── ... ── Addmm ── inputs          the input path (I)
                        └─ T ── weight  └─ bias                 hanging off it (W)

W then starts at the branch nodes with the recorded gradients and asks only
for the parameters of that branch, one ``torch.autograd.grad`` per group of
parameters sharing branch nodes, so it computes the weight gradients
(``x^T dy``) and not the input gradients again. When a group has several
branch nodes, one below another, each is seeded with its recorded total, so
nothing arriving along the input path is counted twice. Parameters that hang
off no input path (the first stage, whose input needs no gradient) are W's
from the outputs.

A compiled block (``compile=``, :mod:`pipe.compile`) is one autograd
node whose backward, AOT autograd's, computes its input and weight gradients
together whatever is asked. Seeding it again in W would run that backward a
second time, so I keeps what it returns for the parameters (a post-hook on
the node) and W only accumulates those into ``.grad``: the split then costs
no extra compute, and holds a stage's weight gradients per cell between I
and W.

Measured with ``python benchmarks/zero_bubble.py --split-only`` (one P5 stage:
4 blocks of ``Linear(1024, 1024) + ReLU``, 1024 rows, one thread): I + W as
here costs 1.00-1.01x a fused backward (I 91 ms + W 91 ms against 182 ms).
A plain ``torch.autograd.backward(outputs, inputs=parameters)`` for W costs
1.38-1.47x: W walks the input path again and recomputes every input gradient
but the first (W 159-167 ms instead of 91 ms).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipe.core.checkpoint import Checkpointing

__all__: list[str] = []

_OUTPUTS = object()  # the group key of parameters reached from the outputs without an input path


class IWBackward:
    """The two halves of one cell's backward.

    Args:
        outputs: the tensors to differentiate (a stage's outputs, or its scaled loss).
        grads: their gradients, None where an output gets none (``grads=None``: ones, for a scalar loss).
        inputs: the cell's input leaves; those requiring grad get gradients from I.
        parameters: the parameters whose ``.grad`` W accumulates.

    Usage::

        split = IWBackward(outputs, grads, inputs, parameters)
        input_grads = split.backward_input()     # I: send these upstream
        ...
        split.backward_weight()                  # W: parameters' .grad, graph freed
    """

    def __init__(self, outputs: Sequence[Tensor], grads: Optional[Sequence[Optional[Tensor]]],
                 inputs: Sequence[Tensor], parameters: Sequence[Tensor]) -> None:
        given = list(grads) if grads is not None else [torch.ones_like(o) for o in outputs]
        pairs = [(o, g) for o, g in zip(outputs, given) if o.requires_grad and g is not None]
        self._outputs = [o for o, _ in pairs]
        self._grads: list[Tensor] = [g for _, g in pairs]
        self._inputs = list(inputs)
        self._parameters = [p for p in parameters if p.requires_grad]
        self._recorded: dict[Node, tuple[Optional[Tensor], ...]] = {}
        self._fused: dict[Node, tuple[Optional[Tensor], ...]] = {}  # a compiled node's gradients, from I
        self._groups: list[tuple[list[Tensor], list[Node], bool]] = []  # params, branch nodes, from outputs
        self._done_input = False

    # -- I ----------------------------------------------------------------------------------------

    def backward_input(self) -> list[Optional[Tensor]]:
        """The gradients of the inputs (None where an input needs none); keeps the graph for W.

        Raises:
            RuntimeError: called twice.
        """
        if self._done_input:
            raise RuntimeError("backward_input() ran already for this cell; each cell has one I")
        self._done_input = True
        wanted = [x for x in self._inputs if x.requires_grad]
        self._plan(wanted)
        result: list[Optional[Tensor]] = [None] * len(self._inputs)
        if not wanted or not self._outputs:
            return result
        branches = {node for _, nodes, _ in self._groups for node in nodes}
        handles = [node.register_prehook(self._recorder(node)) for node in branches]
        handles += [node.register_hook(self._keeper(node)) for node in branches if _is_fused(node)]
        try:
            grads = torch.autograd.grad(self._outputs, wanted, self._grads, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        if not any(from_outputs for _, _, from_outputs in self._groups):
            self._outputs, self._grads = [], []  # W starts at the branch nodes: the output gradients can go
        found = iter(grads)
        return [next(found) if x.requires_grad else None for x in self._inputs]

    def _recorder(self, node: Node) -> Any:
        def record(grad_outputs: tuple[Optional[Tensor], ...]) -> None:
            self._recorded[node] = grad_outputs
        return record

    def _keeper(self, node: Node) -> Any:
        def keep(grad_inputs: tuple[Optional[Tensor], ...], grad_outputs: tuple[Optional[Tensor], ...]) -> None:
            self._fused[node] = grad_inputs
        return keep

    # -- W ----------------------------------------------------------------------------------------

    def backward_weight(self) -> None:
        """Accumulates the parameters' gradients into ``.grad`` and lets the graph go.

        Raises:
            RuntimeError: called before :meth:`backward_input`.
        """
        if not self._done_input:
            raise RuntimeError("backward_weight() needs backward_input() first: W reuses the graph I walked")
        try:
            for parameters, nodes, from_outputs in self._groups:
                self._weight_group(parameters, nodes, from_outputs)
        finally:
            self._outputs, self._grads, self._inputs, self._groups = [], [], [], []
            self._recorded.clear()
            self._fused.clear()

    def _kept_gradients(self, parameters: list[Tensor], nodes: list[Node]) -> Optional[list[Optional[Tensor]]]:
        """The parameters' gradients that I's walk of compiled nodes returned; None where one is missing."""
        if not nodes or not all(node in self._fused for node in nodes):
            return None
        found: list[Optional[Tensor]] = []
        for parameter in parameters:
            leaf = get_gradient_edge(parameter).node
            total: Optional[Tensor] = None
            for node in nodes:
                for k, (child, _) in enumerate(node.next_functions):
                    if child is leaf:
                        grad = self._fused[node][k]
                        if grad is None:
                            return None  # pruned by the engine: walk the graph instead
                        total = grad if total is None else total + grad
            if total is None:
                return None  # reached through other nodes: walk the graph instead
            found.append(total)
        return found

    def _weight_group(self, parameters: list[Tensor], nodes: list[Node], from_outputs: bool) -> None:
        kept = None if from_outputs else self._kept_gradients(parameters, nodes)
        if kept is not None:  # compiled blocks: I computed these already; accumulate them (hooks run)
            torch.autograd.backward(parameters, kept)
            return
        roots: list[Any] = []
        seeds: list[Tensor] = []
        if from_outputs:
            roots += self._outputs
            seeds += self._grads
        for node in nodes:
            for k, grad in enumerate(self._recorded.get(node, ())):
                if grad is not None:
                    roots.append(GradientEdge(node, k))
                    seeds.append(grad)
        if not roots:
            return  # no gradient reached this group: its parameters get none, as in a fused backward
        handles = []
        if len(nodes) + from_outputs > 1:  # a branch node below another receives its recorded total only
            for node in nodes:
                recorded = self._recorded.get(node)
                if recorded is not None:
                    handles.append(node.register_prehook(lambda _, total=recorded: total))
        try:  # accumulates into .grad as a fused backward does (hooks on parameters run)
            torch.autograd.backward(roots, seeds, retain_graph=True, inputs=parameters)
        finally:
            for handle in handles:
                handle.remove()

    # -- the graph --------------------------------------------------------------------------------

    def _plan(self, wanted: list[Tensor]) -> None:
        """Groups the parameters by the branch nodes they hang from (see the module docstring)."""
        starts = [o.grad_fn for o in self._outputs if o.grad_fn is not None]
        parents: dict[Node, list[Node]] = {}  # node -> the nodes whose next functions hold it
        queue = deque(starts)
        seen = set(starts)
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
        input_path = _closure([get_gradient_edge(x).node for x in wanted], parents, stop=set())
        # Parameters that share a branch node (or both hang from the outputs) form one group.
        groups: list[tuple[list[Tensor], set[Any]]] = []
        for parameter in self._parameters:
            leaf = get_gradient_edge(parameter).node
            if leaf not in seen:
                continue  # not in this graph: the forward did not use it
            reached = _closure([leaf], parents, stop=input_path)
            keys: set[Any] = {n for n in reached if n in input_path}
            if any(n in reached and n not in input_path for n in starts):
                keys.add(_OUTPUTS)
            joined = [g for g in groups if g[1] & keys]
            merged = ([p for g in joined for p in g[0]] + [parameter], set().union(keys, *(g[1] for g in joined)))
            groups = [g for g in groups if not g[1] & keys] + [merged]
        self._groups = [(params, [k for k in keys if k is not _OUTPUTS], _OUTPUTS in keys)
                        for params, keys in groups]


def _is_fused(node: Node) -> bool:
    """A compiled region's node (AOT autograd): its backward returns every gradient at once."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _closure(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """The nodes reachable from ``starts`` against the graph's edges (towards the outputs),
    entering but not going past the nodes in ``stop``."""
    found = set(starts)
    queue = deque(n for n in starts if n not in stop)
    while queue:
        for parent in parents.get(queue.popleft(), []):
            if parent not in found:
                found.add(parent)
                if parent not in stop:
                    queue.append(parent)
    return found


def backward_input_first(outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor],
               parameters: Sequence[Tensor], record: Optional[Checkpointing] = None,
               loss: Optional[Tensor] = None) -> tuple[IWBackward, list[Tensor]]:
    """The split backward of one (micro-batch, stage) cell, its checkpoint recomputed here, once.

    Args:
        outputs: the tensors the cell's forward returned.
        grads: their gradients, aligned with ``outputs`` (None: no gradient);
            ignored when ``loss`` is given.
        inputs: the cell's input leaves.
        parameters: the stage's parameters.
        record: the cell's :class:`~pipe.core.checkpoint.Checkpointing` if it
            was checkpointed: its forward kept no graph, so it is replayed now
            (with the first forward's random state) and that graph serves both I and W.
        loss: on the last stage, the (scaled) loss computed from ``outputs``.

    Returns:
        ``(split, inputs)``: the halves to run, and the input leaves whose
        gradients :meth:`IWBackward.backward_input` returns (the replayed
        ones for a checkpointed cell, aligned with ``inputs``).
    """
    if record is None:
        if loss is not None:
            return IWBackward([loss], None, inputs, parameters), list(inputs)
        return IWBackward(outputs, grads, inputs, parameters), list(inputs)
    if loss is not None:  # stop at the checkpoint's outputs: their graph is the one to replay
        wanted = [k for k, t in enumerate(outputs) if t.requires_grad]
        found = torch.autograd.grad(loss, [outputs[k] for k in wanted], allow_unused=True) if wanted else ()
        given: list[Optional[Tensor]] = [None] * len(outputs)
        for k, grad in zip(wanted, found):
            given[k] = grad
        grads = given
    # The cell's one recomputation: done already if the runner called record.recompute_ahead()
    # while the gradient was on its way, else now.
    replayed, leaves = record.recomputed.pop() if record.recomputed else record.replay(record.batch.tensors)
    if len(replayed) != len(outputs):
        raise RuntimeError(f"the recomputed forward returned {len(replayed)} tensors but the first one "
                           f"{len(outputs)}; a checkpointed stage must be deterministic in its structure")
    pairs = [(o, g) for o, g in zip(replayed, grads) if g is not None and o.requires_grad]
    split = IWBackward([o for o, _ in pairs], [g for _, g in pairs], leaves, parameters)
    return split, leaves
