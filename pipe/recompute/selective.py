"""Op-level selective recompute: recompute chosen operations of a layer, keep the rest.

MindSpore's ``Primitive.recompute()``, MindFormers' ``select_recompute`` and
Megatron's "selective" recompute drop the outputs of a few cheap operations
that hold much memory (activations, softmax) and recompute them in backward.
This module builds that on PyTorch's selective activation checkpointing
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the layer
runs under a non-reentrant checkpoint whose policy says, for every ATen op,
``MUST_RECOMPUTE`` or ``MUST_SAVE``.

What to keep and what to replay is decided by :mod:`pipe.recompute.op_decisions`,
from a recorded plain forward of the layer.
"""
from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from pipe.core.deprecation import warn
from pipe.recompute.module import Policy, checkpoint, mark, policy_of
from pipe.recompute.op_decisions import OpDecisions, OpRecorder, Selection, decide_ops
from pipe.recompute.replay import below
from pipe.recompute.scope import Scope

__all__: list[str] = []

logger = logging.getLogger(__name__)


# -- the policy --------------------------------------------------------------------------


Signature = tuple[Any, ...]


def _signature(module: nn.Module, args: Any, kwargs: Any) -> Signature:
    leaves = tree_flatten((args, kwargs))[0]
    return (module.training,) + tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, Tensor) else type(x)
        for x in leaves
    )


_warned: set[str] = set()  # sources already warned about in this process (one warning each, not one per layer)
_warned_lock = threading.Lock()


class Usage:
    """How many operations each regex/kind chose, over the layers that use it.

    A pattern or op kind that chose nothing in any layer is most likely a typo
    or a model whose operations go by other names: it gets one warning (a
    ``UserWarning``, once per process, however many layers use it) once every
    layer using it has run, naming the operations and submodules the layer
    has and what to pass instead.

    Args:
        layers: per pattern, how many layers use it (default: 1 each).
        warn: False: count, never warn (the planner's profile, which tries
            the patterns on every layer to learn where they free memory).
    """

    def __init__(self, layers: Optional[dict[str, int]] = None, warn: bool = True) -> None:
        self.layers = dict(layers or {})
        self.warn = warn
        self._probed: dict[str, set[int]] = {}
        self._chosen: dict[str, int] = {}
        self._lock = threading.Lock()

    def report(self, layer: int, chosen: dict[str, int], sources: list[str], names: list[str],
               seen: Sequence[str] = ()) -> None:
        """Counts what ``layer`` chose; warns about a source that chose nothing anywhere.

        Args:
            names: the layer's submodule names; ``seen``: the op names its forward ran.
        """
        with self._lock:
            idle = []
            for source in sources:
                self._probed.setdefault(source, set()).add(layer)
                self._chosen[source] = self._chosen.get(source, 0) + chosen.get(source, 0)
                done = len(self._probed[source]) >= self.layers.get(source, 1)
                if done and not self._chosen[source] and self.warn:
                    idle.append(source)
        for source in idle:
            with _warned_lock:
                if source in _warned:
                    continue
                _warned.add(source)
            warnings.warn(_nothing_chosen(source, names, seen), UserWarning, stacklevel=2)

    def __getstate__(self) -> dict[str, Any]:
        return {"layers": self.layers, "warn": self.warn}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layers"], state.get("warn", True))  # type: ignore[misc]


def _nothing_chosen(source: str, names: list[str], seen: Sequence[str]) -> str:
    """The warning for ``source`` choosing nothing: what the layer runs, and what to pass instead."""
    ops = sorted(set(seen))
    message = f"select_recompute {source!r} chose no operation in any of its layers, so it recomputes nothing. "
    hints = []
    if source == "op:gelu" and "tanh" in ops:
        hints.append("GELU written as arithmetic (the tanh approximation, e.g. transformers' gelu_new / "
                     "NewGELUActivation) runs as mul, pow, add and tanh, not as the gelu op: choose its submodule "
                     "by name (names=[r'mlp\\.act']) or pass ops=['tanh']")
    if source == "op:softmax" and "scaled_dot_product_attention" in ops:
        hints.append("softmax runs inside scaled_dot_product_attention (one fused op): pass "
                     "ops=['scaled_dot_product_attention'] to recompute the attention")
    if not source.startswith("op:"):
        hints.append(f"patterns fully match submodule names such as {sorted(names)[:8] or '(no submodules)'}, "
                     "or '<submodule>.<op>' such as 'mlp.act.gelu'")
    if hints:
        message += "; ".join(hints) + ". "
    return message + f"The layer's operations are: {', '.join(ops) or '(none recorded)'}."


class SelectiveRecompute(Policy):
    """Recomputes the chosen operations of a layer in backward and keeps the rest.

    Args:
        layer: the layer (its submodule names are what ``names`` match).
        names: regexes on qualified submodule names or ``<submodule>.<op>``.
        ops: op kinds (``"gelu"``, ``"silu"``, ``"softmax"``) or ATen ops.
        label: how logs name the layer.
        usage: shared by the layers of one config, to warn about a pattern
            that chose nothing anywhere.
        prefix: the qualified name of ``layer`` inside the layer the names
            are relative to (when a policy narrows itself to a submodule).
    """

    _PLANS = 8  # input signatures remembered per layer

    def __init__(self, layer: nn.Module, names: Sequence[str] = (), ops: Sequence[Any] = (),
                 label: str = "", usage: Optional[Usage] = None, prefix: str = "") -> None:
        self.selection = Selection(names, ops)
        self.usage = usage if usage is not None else Usage()
        self.prefix = prefix
        self.delegates: list[nn.Module] = []  # submodules this policy narrowed itself to
        if not self.selection.sources():
            raise ValueError("select_recompute needs at least one name regex or op kind to choose operations")
        self.scope = Scope.of(layer)
        self.label = label or type(layer).__name__
        self._plans: OrderedDict[Signature, OpDecisions] = OrderedDict()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"select_recompute {self.selection.sources()}"

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        signature = _signature(module, args, kwargs)
        with self._lock:
            plan = self._plans.get(signature)
            if plan is not None and plan.stale:
                plan = None
        if plan is None:
            return self._probe(module, forward, args, kwargs, signature)
        if not plan.regions:
            return forward(*args, **kwargs)  # nothing to free here: a checkpoint would only cost time
        if plan.regions != [""]:
            self._delegate(module, plan.regions)
            return forward(*args, **kwargs)  # the regions' own policies checkpoint them

        def on_mismatch() -> None:
            logger.warning("%s: the operations differ from the first call's; this call keeps every "
                           "output (no saving) and the layer is planned again on its next call", self.label)

        def contexts() -> Any:
            forward_context, replay = create_selective_checkpoint_contexts(plan.policy(on_mismatch))
            if not plan.dead:
                return forward_context, replay
            return forward_context, below(plan.replay_context(), replay)

        return checkpoint(self.regioned(forward, module), *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=contexts, **kwargs)

    def _delegate(self, module: nn.Module, regions: list[str]) -> None:
        """Puts selective policies on the region submodules (once); the layer then runs plainly."""
        if self.delegates:
            return
        named = dict(module.named_modules())
        for region in regions:
            sub = named[region]
            if policy_of(sub) is None:
                prefix = f"{self.prefix}.{region}" if self.prefix else region
                mark(sub, SelectiveRecompute(sub, self.selection.names, self.selection.ops,
                                             label=f"{self.label}.{region}", usage=Usage({}), prefix=prefix))
                self.delegates.append(sub)
        logger.debug("%s: selective recompute narrowed to %s", self.label, regions)

    def release(self, module: nn.Module) -> None:
        for sub in self.delegates:
            if isinstance(policy_of(sub), SelectiveRecompute):
                mark(sub, None)
        self.delegates = []

    def _probe(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], signature: Signature) -> Any:
        """Runs the layer plainly once, recording what autograd keeps, and plans from it."""
        recorder = OpRecorder(self.scope, self.selection, self.prefix, module.buffers())
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda x: x), recorder, \
                self.scope.counting() as calls:
            output = self.regioned(forward, module)(*args, **kwargs)
        plan = decide_ops(recorder.ops, recorder.saved, recorder.last_pack, frozenset(recorder.buffers))
        if self.prefix:  # regions are relative to the layer; this policy is already one
            plan.regions = [""] if plan.regions else []
        elif any(calls.get(region, 0) != 1 for region in plan.regions if region):
            plan.regions = [""]  # a region called twice per forward: keep one checkpoint for the layer
        with self._lock:
            self._plans[signature] = plan
            while len(self._plans) > self._PLANS:
                self._plans.popitem(last=False)
        if self.usage.layers or not self.prefix:
            self.usage.report(id(self), plan.chosen, self.selection.sources(), self.scope.names,
                              [op.name for op in recorder.ops])
        logger.debug("%s: selective plan: %d of %d ops recomputed, frees %d bytes, keeps %d extra bytes; "
                     "chosen: %s", self.label,
                     sum(d == CheckpointPolicy.MUST_RECOMPUTE for d in plan.decisions), len(plan.decisions),
                     plan.freed_bytes, plan.extra_bytes, plan.chosen)
        return output

    def decisions(self) -> list[OpDecisions]:
        """The per-op decisions made so far (one per input signature)."""
        with self._lock:
            return list(self._plans.values())

    def plans(self) -> list[OpDecisions]:
        """Deprecated: :meth:`decisions`."""
        warn("SelectiveRecompute.plans()", "SelectiveRecompute.decisions()")
        return self.decisions()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_plans"] = OrderedDict()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def select_recompute(layer: nn.Module, names: Union[str, Sequence[str]] = (),
                     ops: Union[str, Iterable[Any]] = (), label: str = "") -> nn.Module:
    """Marks ``layer`` for op-level selective recompute and returns it.

    Usage::

        select_recompute(block, names=[r"mlp\\.act"], ops=["softmax"])

    The first call for each input shape runs plainly to plan which outputs to
    keep (and the second too, where the plan narrows to submodules); later
    calls keep only those. Outputs and gradients equal the
    unmarked layer's.

    Args:
        layer: the layer, e.g. one transformer block.
        names: regexes fully matching a submodule's qualified name in
            ``layer.named_modules()`` (all its operations are chosen) or
            ``<submodule>.<op>`` (e.g. ``attn\\.softmax``).
        ops: op kinds chosen wherever they run in the layer.
        label: how logs name the layer.

    Raises:
        ValueError: nothing to choose, a bad regex or an unknown op kind.
    """
    names = [names] if isinstance(names, str) else list(names)
    ops = [ops] if isinstance(ops, str) else list(ops)
    return mark(layer, SelectiveRecompute(layer, names, ops, label))
