"""Tied parameters across ranks: one replica per holding rank, gradients summed before the optimizer step.

When stages on different ranks hold the same parameter (the embedding of the
first stage is the LM head of the last), each of those ranks keeps a replica,
as DeepSpeed's ``TiedLayerSpec`` and Megatron's embedding group do::

    rank 0: stage 0 uses W (replica)          rank 1: stage 1 uses W (replica)
            backward -> dW0                           backward -> dW1
                      all_reduce(SUM) over the tie's ranks: both hold dW0 + dW1
            optimizer.step() on each rank: the same update, the replicas stay equal

The sum is the plain model's gradient of the one weight, so every rank's
optimizer makes the plain model's update. Replicas start equal: the first
holding rank broadcasts its value at construction. Each replica appears in its
rank's state dict under the rank's names (the same values on every holder).
Only the ranks holding a tie meet in its group (one group per tie and
data-parallel replica, created collectively by every rank).

Ties are found by object identity in the model every rank describes, so they
need an ``nn.Sequential`` (such as :func:`pipe.split`'s result); a layer
factory builds each layer apart and cannot tie. Buffers shared across ranks
are refused: their in-place updates cannot be summed.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipe.core.schedule import Schedule
from pipe.distributed.group import Topology
from pipe.core.original_names import partition_name
from pipe.core.tying import find_ties

__all__: list[str] = []

logger = logging.getLogger(__name__)


class TiedReplicas:
    """The parameters this rank shares with stages of other ranks, and their process groups.

    Args:
        skeleton: every stage's layers (the same model on every rank).
        schedule: says which rank runs each stage.
        topology: this rank's place and the group factory.

    Raises:
        ValueError: a buffer is shared by stages of different ranks.
    """

    def __init__(self, skeleton: Sequence[nn.Module], schedule: Schedule, topology: Topology) -> None:
        self._mine: list[tuple[str, Tensor, dist.ProcessGroup]] = []
        self._places: list[tuple[nn.Module, str]] = []  # where each of mine is registered on this rank
        self._not_first: set[int] = set()
        sources: list[int] = []
        # Ties between stages of one rank, described the same on every rank (FSDP refuses them).
        self.within_rank: list[str] = []
        for tie in find_ties(skeleton):  # the same ties, in the same order, on every rank
            stages = tie.partitions
            ranks = sorted({schedule.rank_of(s) for s in stages})
            for r in ranks:
                together = [s for s in stages if schedule.rank_of(s) == r]
                if len(together) > 1:
                    name = partition_name(skeleton[together[0]], tie.name(together[0]))
                    self.within_rank.append(f"{name!r} of stages {together} on pipeline rank {r}")
            if len(ranks) < 2:
                continue
            name = partition_name(skeleton[stages[0]], tie.name(stages[0]))  # the plain model's
            if tie.is_buffer:
                raise ValueError(
                    f"buffer {name!r} of stage {stages[0]} is shared with stage(s) {stages[1:]} on other ranks; a "
                    "buffer cannot be tied across ranks (its in-place updates cannot be summed): give the layers "
                    "separate buffers, or balance the stages holding it onto one rank"
                )
            for pipeline in range(topology.pipelines):
                group = topology.new_group([topology.global_rank(r, pipeline) for r in ranks], f"tied {name}")
                if pipeline == topology.pipeline and topology.pipeline_rank in ranks:
                    if group is None:
                        raise RuntimeError(f"rank {dist.get_rank()} got no process group for the tie {name!r} "
                                           "it is a member of: a bug in pipe, please report it")
                    self._mine.append((name, tie.tensor, group))
                    mine = set(schedule.stages_of(topology.pipeline_rank))
                    self._places.append(next((m, attr) for j, m, attr, _ in tie.uses if j in mine))
                    if topology.pipeline_rank != ranks[0]:
                        self._not_first.add(id(tie.tensor))
                    sources.append(topology.global_rank(ranks[0]))
                    logger.info("tied %r over pipeline ranks %s (stages %s)", name, ranks, stages)
        # After every group exists (new_group is collective over the world): replicas start equal.
        with torch.no_grad():
            for (_, tensor, group), source in zip(self._mine, sources):
                dist.broadcast(tensor.data, source, group=group)

    def __len__(self) -> int:
        return len(self._mine)

    def refresh(self) -> None:
        """Finds the tied parameters again where they are registered (``fully_shard`` replaces them by DTensors)."""
        not_first = {k for k, (_, tensor, _) in enumerate(self._mine) if id(tensor) in self._not_first}
        for k, ((name, _, group), (module, attr)) in enumerate(zip(self._mine, self._places)):
            self._mine[k] = (name, module._parameters[attr], group)  # type: ignore[assignment]
        self._not_first = {id(self._mine[k][1]) for k in not_first}

    def verify_layouts(self) -> None:
        """Checks that every holder of a tie holds it alike (collective over each tie's ranks).

        Tensor parallelism may shard the first stage's embedding and the last
        stage's head differently; their gradients' local tensors could not be summed.

        Raises:
            ValueError: two holders differ; the message gives both layouts and the fix.
        """
        for name, tensor, group in self._mine:
            layout = _layout(tensor)
            layouts: list[object] = [None] * dist.get_world_size(group)
            dist.all_gather_object(layouts, layout, group=group)
            different = [other for other in layouts if other != layout]
            if different:
                raise ValueError(
                    f"the tied weight {name!r} is laid out differently on the ranks that hold it: {layout} here, "
                    f"{different[0]} on another; their gradients cannot be summed. Shard it alike in every stage "
                    f"that uses it (an embedding under RowwiseParallel and a head under ColwiseParallel both shard "
                    f"the vocabulary, Shard(0)), or leave both replicated")

    def reduce_gradients(self) -> None:
        """Sums each tied parameter's gradient over its holders (every holding rank must call it).

        A sharded (DTensor) parameter sums its local shards: every holder shards it alike over "dp_shard".
        """
        for _, tensor, group in self._mine:
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
            grad = tensor.grad
            if isinstance(grad, DTensor) and isinstance(tensor, DTensor) and grad.placements != tensor.placements:
                # An embedding under RowwiseParallel gets a replicated gradient of its vocabulary-sharded weight:
                # take this rank's shard (a slice, no communication), laid out as every holder's.
                grad = tensor.grad = grad.redistribute(tensor.device_mesh, tensor.placements)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)

    def counts(self, parameter: Tensor) -> bool:
        """Whether ``parameter``'s gradient counts in a global norm on this rank (one holder counts a tie)."""
        return id(parameter) not in self._not_first


def _layout(tensor: Tensor) -> str:
    """A tensor's layout across its mesh, as text every rank can compare."""
    if isinstance(tensor, DTensor):
        return (f"DTensor{tuple(tensor.shape)} on mesh {tensor.device_mesh.mesh_dim_names} placements "
                f"{tuple(tensor.placements)}, local {tuple(tensor.to_local().shape)}")
    return f"a plain tensor of shape {tuple(tensor.shape)}"
