"""Data parallel replicas of a stage: average gradients over the stage's replicas.

With ``world = pipeline ranks x replicas``, the ranks holding the same stages
form a group (:mod:`pipe.distributed.group`). After a stage's last backward of
the step its gradients are averaged in that group with bucketed, asynchronous
all-reduces, so that in an interleaved schedule the reduction of one stage
overlaps with the backward of the rank's other stages. DDP would do the same
per layer but wraps a module that runs its own forward; a stage's forward is
driven by the schedule, so the reduction is started by the runner instead.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipe.core.lowering import Kind, Step

__all__: list[str] = []

logger = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 1024 * 1024  # as DDP's default bucket_cap_mb


class GradientAverager:
    """Averages the gradients of each stage over its data-parallel group.

    Args:
        stages: this rank's stages by stage index.
        group: the data-parallel group of this rank.
        replicas: the size of the group.
    """

    def __init__(self, stages: dict[int, nn.Module], group: Optional[dist.ProcessGroup], replicas: int) -> None:
        self.stages = stages
        self.group = group
        self.replicas = replicas
        self._inflight: list[tuple[dist.Work, Tensor, list[Tensor]]] = []

    def executors(self) -> dict[Kind, Callable[[Step], None]]:
        """The runner's executors of the replicas' steps of a lowered program."""
        return {Kind.REDUCE_REPLICAS: lambda step: self.start(step.stage),
                Kind.FINISH_REPLICAS: lambda step: self.finish()}

    def start(self, stage: int) -> None:
        """Starts averaging the gradients of ``stage`` (returns at once)."""
        # A tensor-parallel stage's gradients are DTensors: every replica holds the same shard of each, so
        # the local shards are averaged (a view of each DTensor's memory, written back in place).
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in self.stages[stage].parameters() if p.grad is not None]
        bucket: list[Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= BUCKET_BYTES:
                self._launch(bucket)
                bucket, size = [], 0
        if bucket:
            self._launch(bucket)

    def _launch(self, bucket: list[Tensor]) -> None:
        # One dtype per flat buffer; mixed-precision models get one buffer per dtype.
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in bucket:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            assert work is not None
            self._inflight.append((work, flat, grads))

    def finish(self) -> None:
        """Waits for the reductions and writes the averages back into ``.grad``."""
        inflight, self._inflight = self._inflight, []
        for work, flat, grads in inflight:
            work.wait()
            flat.div_(self.replicas)
            offset = 0
            for grad in grads:
                n = grad.numel()
                grad.copy_(flat[offset:offset + n].view_as(grad))
                offset += n
