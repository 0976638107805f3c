"""What autograd keeps: record a layer's plain forward and decide which ops to save, recompute or skip.

Why a plan, not just "chosen ops recompute, the rest save": selective
checkpointing saves the *outputs* of the ops marked save, whereas plain
autograd keeps whatever each backward formula needs. "Save everything else"
would keep tensors backward never needed (the pre-softmax scores, the output of
the last matmul) and can use more memory than no recompute at all. So the first
call of a layer for an input signature runs plainly and records which op
outputs autograd really keeps (saved-tensor hooks, a dispatch mode); the plan
then marks an op

- recompute if it is chosen, or if it produces an input of a recomputed op
  that autograd did not keep anyway (``softmax`` pulls in the ``q @ k^T`` that
  feeds it: keeping the scores would cost as much as keeping the
  probabilities);
- save if autograd keeps its output (it is held anyway: saving costs nothing);
- skip if autograd does not keep its output and no replayed op reads it (the
  qkv matmul whose q, k, v are kept as contiguous copies): the replay gets an
  uninitialised tensor of the right shape instead of running it (a dispatch
  mode under the replay, :class:`pipe.recompute.replay.SkipDead`), so it costs neither memory nor
  FLOPs; ops that draw random numbers or write in place always replay;
- otherwise recompute if it comes after the last kept tensor (checkpoint's
  early stop never replays it) or is cheap, and save if it is a matmul.

The plan also finds the smallest submodules that hold the chosen ops which
free memory, the ops rebuilding their inputs and the ops keeping their outputs
(``attn`` for the softmax, ``mlp`` for the GELU): the policy then narrows
itself to those submodules, so that a backward replays a few ops rather than
the whole layer (the next call plans them in turn).

A chosen op whose output autograd does not keep saves nothing by being
recomputed, and a chosen op whose output the next op keeps saves it only here,
because the next op's saved input is rebuilt in backward from the chosen op's
recomputation; with module-level recompute of the op alone (checkpointing just
``nn.GELU``), the next op would still keep the output and nothing would be
saved. The plan logs both at DEBUG.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

from pipe.core.inplace import plain_tensors
from pipe.recompute.scope import Scope, compile_pattern

if TYPE_CHECKING:
    from pipe.recompute.replay import SkipDead

__all__: list[str] = []

logger = logging.getLogger(__name__)

# ATen names that users know under another name.
_ALIASES = {
    "_softmax": "softmax",
    "_safe_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_dropout": "dropout",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_fused_rms_norm": "rms_norm",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
}
_KNOWN_KINDS = frozenset(_ALIASES.values())

# Ops whose recomputation costs real FLOPs: kept unless chosen or needed.
_HEAVY = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "scaled_dot_product_attention",
                    "_efficient_attention_forward", "_flash_attention_forward"})


def op_name(func: Any) -> str:
    """The name an ATen op is chosen by: ``gelu``, ``softmax``, ``addmm``, ``dropout``..."""
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(packet)).split(".")[-1]
    return _ALIASES.get(name, name)


def _verify_kind(kind: Any) -> str:
    if not isinstance(kind, str):
        return op_name(kind)
    name = kind.lower()
    if name in _KNOWN_KINDS or name in _ALIASES or hasattr(torch.ops.aten, name):
        return _ALIASES.get(name, name)
    raise ValueError(
        f"unknown op kind {kind!r}; use an ATen op name such as 'gelu', 'silu', 'relu', 'softmax', "
        f"'dropout', 'layer_norm', 'mul', 'addmm', 'bmm' (see torch.ops.aten)"
    )


class Selection:
    """Which operations of a layer are chosen: by name regex and/or by op kind.

    A regex chooses an operation when it fully matches the qualified name of a
    submodule the operation runs in (``mlp``, ``mlp.act``), or
    ``<innermost submodule>.<op name>`` (``mlp.act.gelu``, ``attn.softmax``;
    just ``<op name>`` for code in the layer's own ``forward``).

    Args:
        names: regexes on qualified names.
        ops: op kinds (``"gelu"``, ``"softmax"``) or ATen ops (``torch.ops.aten.gelu``).

    Raises:
        ValueError: a regex does not compile or an op kind is unknown.
    """

    def __init__(self, names: Sequence[str] = (), ops: Sequence[Any] = ()) -> None:
        if isinstance(names, str):
            names = [names]
        if isinstance(ops, str):
            ops = [ops]
        self.names = tuple(names)
        self._patterns = [(name, compile_pattern(name, "select_recompute")) for name in self.names]
        self.ops = tuple(sorted({_verify_kind(kind) for kind in ops}))
        self._cache: dict[tuple[tuple[str, ...], str], Optional[str]] = {}

    def match(self, enclosing: Sequence[str], name: str) -> Optional[str]:
        """The regex or ``op:<kind>`` that chooses op ``name`` running in ``enclosing``, or None."""
        key = (tuple(enclosing), name)
        if key in self._cache:
            return self._cache[key]
        found: Optional[str] = None
        innermost = enclosing[-1] if enclosing else ""
        candidate = f"{innermost}.{name}" if innermost else name
        for source, pattern in self._patterns:
            if pattern.fullmatch(candidate) or any(pattern.fullmatch(path) for path in enclosing):
                found = source
                break
        if found is None and name in self.ops:
            found = f"op:{name}"
        self._cache[key] = found
        return found

    def sources(self) -> list[str]:
        return list(self.names) + [f"op:{kind}" for kind in self.ops]

    def __getstate__(self) -> dict[str, Any]:
        return {"names": self.names, "ops": self.ops}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["names"], state["ops"])  # type: ignore[misc]


# -- recording the plain forward ---------------------------------------------------------


@dataclass
class _Op:
    func: Any
    name: str
    inputs: list[int]                      # storage addresses of tensor inputs
    outputs: list[tuple[int, int]]         # (storage address, bytes) of tensor outputs
    chosen_by: Optional[str]
    mutates: bool = False                  # an in-place op (bernoulli_, add_, relu_...)
    seeded: bool = False                   # draws random numbers (never skipped in the replay)
    meta: Optional[tuple[Any, ...]] = None  # (shape, stride, dtype, device) of a single tensor output
    path: str = ""                         # the innermost submodule it ran in


def _prefixed(prefix: str, names: list[str]) -> list[str]:
    """Names relative to a submodule ``prefix`` of the layer, made relative to the layer."""
    if not prefix:
        return names
    return [prefix] + [f"{prefix}.{name}" for name in names]


def _common(paths: Iterable[str]) -> str:
    """The deepest submodule enclosing every one of ``paths`` ('' for the layer itself)."""
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


class OpRecorder(TorchDispatchMode):
    """Records every op of a plain forward (the ops selective checkpointing will see).

    Storages are named by an id of their own rather than their address: an
    address is reused once a storage is freed, and keeping every output alive
    to prevent that would make the recorded forward hold every intermediate
    (1.5x to 1.7x the memory of the plain forward on transformer blocks). With
    ids, the recorded forward holds what the plain one holds.

    Args:
        scope: the layer's submodule tracking.
        selection: what is chosen.
        prefix: the layer's name inside the layer the selection is relative to.
        buffers: the layer's buffers (running statistics...): an in-place op on
            one is replayed (on scratch copies, :mod:`pipe.recompute.stats`),
            never cached, since the buffer changes after the forward.
    """

    def __init__(self, scope: Scope, selection: Selection, prefix: str = "",
                 buffers: Iterable[Tensor] = ()) -> None:
        super().__init__()
        self.scope = scope
        self.selection = selection
        self.prefix = prefix
        self.ops: list[_Op] = []
        self.saved: set[int] = set()
        self.last_pack = 0  # ops recorded when the last tensor was saved for backward
        self._ids: dict[int, int] = {}  # address of a live storage -> its id
        self._next = 0
        self.buffers = {i for i, _ in self.storages(list(buffers))}

    def storages(self, value: Any) -> list[tuple[int, int]]:
        """``(id, bytes)`` of the storages of the tensors in ``value`` (a DTensor's: its local shard's)."""
        out = []
        for leaf in plain_tensors(tree_flatten(value)[0]):
            if leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                size = storage.nbytes()
                if size:
                    out.append((self._id(storage), size))
        return out

    def _id(self, storage: Any) -> int:
        address = storage.data_ptr()
        known = self._ids.get(address)
        if known is not None:
            return known
        self._next += 1
        self._ids[address] = self._next
        weakref.finalize(storage, self._forget, address, self._next)
        return self._next

    def _forget(self, address: int, ident: int) -> None:
        if self._ids.get(address) == ident:
            del self._ids[address]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        name = op_name(func)
        schema = getattr(func, "_schema", None)
        meta = (tuple(out.shape), out.stride(), out.dtype, out.device) if isinstance(out, Tensor) else None
        enclosing = _prefixed(self.prefix, self.scope.enclosing())
        self.ops.append(_Op(func, name, [p for p, _ in self.storages((args, kwargs))], self.storages(out),
                            self.selection.match(enclosing, name),
                            bool(getattr(schema, "is_mutable", False)),
                            torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()), meta,
                            enclosing[-1] if enclosing else ""))
        return out

    def pack(self, tensor: Tensor) -> Tensor:
        for ident, _ in self.storages(tensor):
            self.saved.add(ident)
        self.last_pack = len(self.ops)
        return tensor


@dataclass
class OpDecisions:
    """Per-op decisions for one input signature of a layer."""

    ops: list[Any]
    decisions: list[CheckpointPolicy]
    chosen: dict[str, int] = field(default_factory=dict)  # regex/kind -> ops it chose
    freed_bytes: int = 0    # bytes autograd keeps that the plan recomputes instead
    extra_bytes: int = 0    # bytes the plan keeps that autograd would not
    dead: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # op index -> output meta
    # The smallest submodules holding the chosen ops that free memory, the ops that rebuild
    # their inputs and the ops that keep their outputs; [""] for the whole layer, [] if none.
    regions: list[str] = field(default_factory=list)
    stale: bool = False

    def replay_context(self) -> "SkipDead":
        """Under the recomputation: dead ops yield uninitialised tensors instead of running."""
        from pipe.recompute.replay import SkipDead  # replay.py reads this module's plans

        return SkipDead(self)

    def policy(self, on_mismatch: Callable[[], None]) -> Callable[..., CheckpointPolicy]:
        """A fresh policy function for one checkpointed call (ops are counted per call)."""
        counter = replayed = 0
        ops, decisions = self.ops, self.decisions
        given: list[CheckpointPolicy] = []  # this call's answers, in the forward's order

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            nonlocal counter, replayed
            if getattr(ctx, "is_recompute", False):
                # torch 2.11 asks again during the replay and looks up what it is told was saved
                # (torch 2.13 replays from what the forward stored): the forward's answer, call by call.
                k = replayed
                replayed += 1
                return given[k] if k < len(given) else CheckpointPolicy.MUST_RECOMPUTE
            i = counter
            counter += 1
            if self.stale or i >= len(ops) or ops[i] is not func:
                if not self.stale:
                    self.stale = True
                    on_mismatch()
                given.append(CheckpointPolicy.MUST_SAVE)  # always correct; re-planned on the next call
            else:
                given.append(decisions[i])
            return given[-1]

        return policy


def decide_ops(ops: list[_Op], saved: set[int], last_pack: int, buffers: frozenset[int] = frozenset()) -> OpDecisions:
    """Decides recompute/save for every recorded op (see the module docstring).

    ``buffers`` are the storages of the layer's buffers: an in-place update of
    one (a train-mode batch norm's ``num_batches_tracked += 1``) is replayed,
    not cached, as the buffer changes after the forward.
    """
    creator: dict[int, int] = {}
    created: list[list[tuple[int, int]]] = []
    for k, op in enumerate(ops):
        mine = [(p, n) for p, n in op.outputs if p not in creator and p not in op.inputs]
        for p, _ in mine:
            creator[p] = k
        created.append(mine)
    kept = [any(p in saved for p, _ in mine) for mine in created]
    # A storage written in place later (CPU dropout: empty_like, bernoulli_, div_) must be
    # rebuilt by replaying every write: a cached copy would be stale, and code keeps using
    # the variable, not the cached return value.
    mutated = {p for op in ops if op.mutates for p, _ in op.outputs}

    recompute: set[int] = {k for k, op in enumerate(ops) if op.chosen_by is not None and created[k]}
    stack = list(recompute)
    while stack:  # producers of recomputed inputs that autograd did not keep
        k = stack.pop()
        for p in ops[k].inputs:
            c = creator.get(p)
            if c is None or c in recompute or kept[c] or c >= k:
                continue
            recompute.add(c)
            stack.append(c)

    decisions: list[CheckpointPolicy] = []
    plan = OpDecisions([op.func for op in ops], decisions)
    for k, op in enumerate(ops):
        if not created[k]:
            # A view or in-place op follows the op that created its storage.
            owner = creator.get(op.outputs[0][0]) if op.outputs else None
            if op.mutates and any(p in buffers for p, _ in op.outputs):
                decisions.append(CheckpointPolicy.MUST_RECOMPUTE)
            else:
                decisions.append(decisions[owner] if owner is not None and owner < k
                                 else CheckpointPolicy.MUST_SAVE)
            continue
        size = sum(n for _, n in created[k])
        if k in recompute or any(p in mutated for p, _ in created[k]):
            decisions.append(CheckpointPolicy.MUST_RECOMPUTE)
            plan.freed_bytes += size if kept[k] and k in recompute else 0
        elif kept[k]:
            decisions.append(CheckpointPolicy.MUST_SAVE)
        elif k >= last_pack or op.name not in _HEAVY:
            decisions.append(CheckpointPolicy.MUST_RECOMPUTE)
        else:
            decisions.append(CheckpointPolicy.MUST_SAVE)
            plan.extra_bytes += size
        if op.chosen_by is not None:
            plan.chosen[op.chosen_by] = plan.chosen.get(op.chosen_by, 0) + 1

    # Dead ops: outputs autograd does not keep and no replayed op reads (the qkv matmul
    # whose q/k/v are kept as contiguous copies, the attention output projection). Saving
    # them would cost memory, replaying them FLOPs: the replay skips them (SkipDead).
    needed: set[int] = set()
    for k in range(min(last_pack, len(ops)) - 1, -1, -1):
        op = ops[k]
        if (created[k] and not kept[k] and op.meta is not None and not op.seeded and not op.mutates
                and not any(p in mutated or p in needed for p, _ in created[k])):
            if decisions[k] == CheckpointPolicy.MUST_SAVE:
                plan.extra_bytes -= sum(n for _, n in created[k])
            decisions[k] = CheckpointPolicy.MUST_RECOMPUTE
            plan.dead[k] = op.meta
            continue
        if decisions[k] == CheckpointPolicy.MUST_RECOMPUTE and (created[k] or op.mutates):
            needed.update(op.inputs)
    for k, op in enumerate(ops):  # views follow their storage's creator again
        owner = creator.get(op.outputs[0][0]) if op.outputs and not created[k] else None
        if owner is not None and owner < k and not (op.mutates and any(p in buffers for p, _ in op.outputs)):
            decisions[k] = decisions[owner]

    # Regions: a chosen op whose output autograd keeps, with its producer chain and the ops
    # that keep it. Checkpointing just that submodule replays a few ops instead of the layer.
    group: dict[int, int] = {}

    def find(k: int) -> int:
        while group.get(k, k) != k:
            k = group[k]
        return k

    seeds = [k for k in recompute if ops[k].chosen_by is not None and kept[k]]
    for k in sorted(recompute):
        for p in ops[k].inputs:
            c = creator.get(p)
            if c is not None and c in recompute and c < k:
                group[find(k)] = find(c)
    paths: dict[int, list[str]] = {}
    for k in recompute:
        paths.setdefault(find(k), []).append(ops[k].path)
    freeing = {find(k) for k in seeds}
    for j, op in enumerate(ops):  # the readers of what the seeds and their chains produce
        if created[j] or op.mutates:
            for p in op.inputs:
                c = creator.get(p)
                if c is not None and c in recompute and c != j:
                    paths[find(c)].append(op.path)
    regions = sorted({_common(paths[root]) for root in freeing})
    plan.regions = [r for r in regions if not any(r.startswith(o + ".") for o in regions if o)] \
        if "" not in regions else [""]
    return plan
