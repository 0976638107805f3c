"""Process groups of a pipeline: who is which stage of which pipeline, and who talks to whom.

The job's ``DeviceMesh`` (:mod:`pipe.distributed.mesh`) says where each rank
sits: its coordinate on "pp" is its pipeline rank, and the ranks that share
every other coordinate form one pipeline, which exchanges activations on
channels of its own. The ranks of one pipeline rank across the data-parallel
dimensions average gradients and sum losses::

    make_mesh(pp=2, dp_replicate=2): pipeline 0: ranks 0 2   replica groups: {0, 1}, {2, 3}
                                    pipeline 1: ranks 1 3
    make_mesh(pp=2, dp_shard=2):     pipeline 0: ranks 0 2   shard groups: {0, 1}, {2, 3}
                                    pipeline 1: ranks 1 3

Before anything else the ranks compare their configurations, so that a rank
started with other chunks, balance or schedule fails at once with a message
instead of hanging in its first receive.

Groups are shared by the pipelines of one process (:func:`pipe.distributed.mesh.reuse`):
a second ``DistributedPipe`` (a planner trying candidates, a memory measurement
before training) reuses the groups of the same members and role.
"""
from __future__ import annotations

import datetime
import logging
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from pipe.distributed.mesh import agree_on_reuse, bound_timeouts, mesh_size, reuse, reuse_spoiled
from pipe.distributed.transport import Channel

__all__: list[str] = []

logger = logging.getLogger(__name__)


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call pipe.distributed.init_from_env() first "
            "(under torchrun), or torch.distributed.init_process_group(...)"
        )


def world_timeout() -> datetime.timedelta:
    """The timeout the default process group was created with (``init_process_group(timeout=...)``).

    New groups get PyTorch's default (30 minutes) unless told otherwise, and a
    point-to-point wait on gloo has no timeout at all, so every group and every
    wait of the pipeline is given this one.
    """
    require_initialized()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return dist.group.WORLD._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        from pipe.distributed.env import DEFAULT_TIMEOUT

        return DEFAULT_TIMEOUT


class Topology:
    """Where this rank sits on the mesh, and the process groups a pipeline needs.

    The mesh (:mod:`pipe.distributed.mesh`) has a "pp" dimension and optional
    "dp_replicate", "dp_shard" and "tp" ones. Every combination of the
    coordinates other than "pp" is one *pipeline*: its ranks along "pp" run
    the stages and exchange activations. The ranks of one pipeline rank that
    differ only in their data-parallel coordinates see different data.

    Args:
        mesh: the job's ``DeviceMesh`` (checked by :func:`pipe.distributed.mesh.verify_mesh`).

    Attributes:
        ranks, pipeline_rank: the size of "pp" and this rank's coordinate on it.
        pipelines, pipeline: how many pipelines the mesh holds, and this rank's.
        data_parallel, replica: ``dp_replicate x dp_shard`` (how many parts the
            global batch is split into) and this rank's part.
        replicate, shard, tensor_parallel: the sizes of "dp_replicate", "dp_shard", "tp".
        pipeline_group: the ranks of this pipeline (None with one pipeline rank).
        data_parallel_group: the ranks of this pipeline rank (and "tp"
            coordinate) over both data-parallel dimensions: losses and token counts are summed there.
        replicate_group: the ranks over "dp_replicate" only: replicas average gradients there.
        shard_group: the ranks over "dp_shard" only (FSDP's shards): a sharded norm sums there.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        require_initialized()
        self.mesh = mesh
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.timeout = world_timeout()
        bound_timeouts(mesh, self.timeout)  # FSDP, HSDP and tp collectives end within the job's timeout too
        self._channels: dict[tuple[int, int, str, str], Channel] = {}
        self.names: tuple[str, ...] = tuple(mesh.mesh_dim_names or ())
        self.replicate = mesh_size(mesh, "dp_replicate")
        self.shard = mesh_size(mesh, "dp_shard")
        self.tensor_parallel = mesh_size(mesh, "tp")
        self.data_parallel = self.replicate * self.shard
        grid = mesh.mesh
        self._coordinate = dict(zip(self.names, (int(c) for c in (grid == self.rank).nonzero()[0])))
        self._by_pipeline = grid.movedim(self.names.index("pp"), 0).reshape(grid.shape[self.names.index("pp")], -1)
        self.ranks, self.pipelines = (int(n) for n in self._by_pipeline.shape)
        self.pipeline_rank = self._coordinate["pp"]
        self.pipeline = int((self._by_pipeline[self.pipeline_rank] == self.rank).nonzero()[0])
        self.replica = self._coordinate.get("dp_replicate", 0) * self.shard + self._coordinate.get("dp_shard", 0)
        self.pipeline_group = self._groups_along(("pp",))
        self.data_parallel_group = self._groups_along(("dp_replicate", "dp_shard"))
        self.replicate_group = self._groups_along(("dp_replicate",))
        self.shard_group = self._groups_along(("dp_shard",))

    def coordinate(self, name: str) -> int:
        """This rank's coordinate on mesh dimension ``name`` (0 if the mesh has none)."""
        return self._coordinate.get(name, 0)

    def _groups_along(self, dims: tuple[str, ...]) -> Optional[dist.ProcessGroup]:
        """One group per combination of the other coordinates, spanning ``dims``; this rank's (None if size 1)."""
        present = [self.names.index(d) for d in dims if d in self.names]
        size = math.prod(int(self.mesh.mesh.shape[i]) for i in present)
        if size == 1:
            return None
        others = [i for i in range(len(self.names)) if i not in present]
        rows = self.mesh.mesh.permute(*others, *present).reshape(-1, size)
        mine: Optional[dist.ProcessGroup] = None
        for row in rows.tolist():
            group = self.new_group(row, "+".join(dims))
            if self.rank in row:
                mine = group
        return mine

    def new_group(self, members: list[int], role: str) -> Optional[dist.ProcessGroup]:
        """The process group of ``members`` for ``role``, with the pipeline's timeout; None on a non-member.

        Created on first use (collective over the world) and shared by every
        pipeline of the process afterwards (:func:`pipe.distributed.mesh.reuse`).
        """
        def make() -> Optional[dist.ProcessGroup]:
            group = dist.new_group(members, timeout=self.timeout)
            # torch gives a non-member a sentinel (GroupMember.NON_GROUP_MEMBER), typed as such from torch 2.14
            return group if isinstance(group, dist.ProcessGroup) else None
        return reuse(("group", tuple(members), role, self.timeout.total_seconds()), make)

    def global_rank(self, pipeline_rank: int, pipeline: Optional[int] = None) -> int:
        """The global rank of ``pipeline_rank`` in ``pipeline`` (default: this rank's pipeline)."""
        return int(self._by_pipeline[pipeline_rank, self.pipeline if pipeline is None else pipeline])

    def create_groups(self, routes: list[tuple[int, int, str]], rank_of: Any) -> None:
        """Creates one channel per route and direction, in every pipeline of the mesh.

        Every rank calls this with the same ``routes`` (``(from stage, to
        stage, name)``): ``new_group`` is collective over the whole world.
        """
        for replica in range(self.pipelines):
            for src, dst, name in routes:
                for kind, (a, b) in (("act", (src, dst)), ("grad", (dst, src))):
                    rank_a, rank_b = rank_of(a), rank_of(b)
                    channel_group: Optional[dist.ProcessGroup] = None
                    if rank_a != rank_b:
                        members = sorted({self.global_rank(rank_a, replica), self.global_rank(rank_b, replica)})
                        channel_group = self.new_group(members, f"{kind} {name} {a}->{b}")
                    if replica != self.pipeline:
                        continue
                    label = f"{kind} {name} {a}->{b}"
                    if rank_a == self.pipeline_rank:
                        self._channels[(a, b, kind, name)] = Channel(self.global_rank(rank_b), channel_group, label)
                    if rank_b == self.pipeline_rank:
                        self._channels[(b, a, kind + "-in", name)] = Channel(self.global_rank(rank_a), channel_group, label)

    def outgoing(self, src: int, dst: int, kind: str, name: str) -> Channel:
        """The channel that carries ``kind`` (``"act"`` or ``"grad"``) messages from stage ``src`` to ``dst``."""
        return self._channels[(src, dst, kind, name)]

    def incoming(self, dst: int, src: int, kind: str, name: str) -> Channel:
        """The channel on which stage ``dst`` receives ``kind`` messages from stage ``src``."""
        return self._channels[(dst, src, kind + "-in", name)]


def verify_same_config(config: dict[str, Any]) -> None:
    """Checks that every rank was started with the same ``config``.

    The same exchange tells every rank whether a step failed on any rank since
    the process's shared groups were made; if so, every rank makes new ones
    (:func:`pipe.distributed.mesh.agree_on_reuse`) before any is created.

    Raises:
        ValueError: naming the first field that differs, with each rank's value.
    """
    require_initialized()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (config, reuse_spoiled()))
    agree_on_reuse(any(spoiled for _, spoiled in gathered))
    configs = [c for c, _ in gathered]
    for key in config:
        values = [c.get(key) if isinstance(c, dict) else None for c in configs]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"ranks disagree on {key} ({per_rank}); every rank must build the pipeline with the "
                f"same arguments (pass the same {key} on every rank)"
            )


def union_over_ranks(names: list[str]) -> list[str]:
    """The names every rank found, in order (a refusal at construction is raised on every rank alike)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return list(dict.fromkeys(name for part in gathered for name in part))


def decided_on_rank_0(decide: Callable[[], Any]) -> Any:
    """``decide()``'s result on rank 0, on every rank (one broadcast); a ``TypeError`` or ``ValueError`` it
    raises is raised on every rank, so that no rank waits for a partner that gave up. Collective: every rank
    of the world calls it. For decisions that measure (timings differ between processes; the choice must not)."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message = [decide()]
        except (TypeError, ValueError) as error:
            message = [error]
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], BaseException):
        raise message[0]
    return message[0]
