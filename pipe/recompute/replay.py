"""The replay side of a selective-recompute plan: dead ops skipped, and dispatch modes stacked in order.

:class:`pipe.recompute.op_decisions.OpDecisions` marks the ops whose outputs
neither autograd nor any replayed op reads as dead; under selective
checkpointing's replay mode, :class:`SkipDead` returns an uninitialised tensor
of the recorded shape for each of them instead of running it.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

if TYPE_CHECKING:
    from pipe.recompute.op_decisions import OpDecisions

__all__: list[str] = []


@contextmanager
def below(outer: Any, inner: Any) -> Iterator[None]:
    """Enters ``outer`` then ``inner``: a mode entered first sees what the later one passes down."""
    with outer, inner:
        yield


class SkipDead(TorchDispatchMode):
    """Sits below selective checkpointing's replay mode, which hands it the ops to recompute.

    Ops are matched to the plan by their per-op invocation count (as the replay
    mode does); a dead op returns an uninitialised tensor of its recorded shape.
    """

    def __init__(self, plan: "OpDecisions") -> None:
        super().__init__()
        self.plan = plan
        self.queues: dict[Any, deque[int]] = {}
        for k, (func, decision) in enumerate(zip(plan.ops, plan.decisions)):
            if decision == CheckpointPolicy.MUST_RECOMPUTE:
                self.queues.setdefault(func, deque()).append(k)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        queue = self.queues.get(func)
        if func in SAC_IGNORED_OPS or not queue or self.plan.stale:
            return func(*args, **kwargs)
        meta = self.plan.dead.get(queue.popleft())
        if meta is None:
            return func(*args, **kwargs)
        shape, stride, dtype, device = meta
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


