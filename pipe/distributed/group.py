"""Process groups of a pipeline: who is which stage of which replica, and who talks to whom.

With ``world = pipeline_ranks x replicas`` ranks, consecutive ranks form one
pipeline (replica), and the ranks holding the same stages in every replica
form a data-parallel group::

    world 4, data_parallel 2:   replica 0: ranks 0 1    data-parallel groups: {0, 2}, {1, 3}
                                replica 1: ranks 2 3

Before anything else the ranks compare their configurations, so that a rank
started with other chunks, balance or schedule fails at once with a message
instead of hanging in its first receive.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from pipe.distributed.transport import Channel

__all__ = ["Topology", "verify_same_config", "world_timeout"]

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


@dataclass
class Topology:
    """Where this rank sits: its pipeline rank and replica, and the process groups it needs.

    Args:
        data_parallel: replicas of the pipeline (world size / pipeline ranks).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the world size is not a multiple of ``data_parallel``.
    """

    data_parallel: int = 1
    world: int = field(init=False)
    rank: int = field(init=False)
    ranks: int = field(init=False)  # pipeline ranks per replica
    pipeline_rank: int = field(init=False)
    replica: int = field(init=False)
    data_parallel_group: Optional[dist.ProcessGroup] = field(init=False, default=None)
    timeout: datetime.timedelta = field(init=False)
    _channels: dict[tuple[int, int, str, str], Channel] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        require_initialized()
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        if self.world % self.data_parallel != 0:
            raise ValueError(
                f"world size {self.world} is not divisible by data_parallel={self.data_parallel}; "
                f"the job needs pipeline ranks x replicas processes (e.g. "
                f"{self.data_parallel * max(1, self.world // self.data_parallel)} ranks, or data_parallel dividing {self.world})"
            )
        self.ranks = self.world // self.data_parallel
        self.replica, self.pipeline_rank = divmod(self.rank, self.ranks)
        self.timeout = world_timeout()

    def new_group(self, members: list[int]) -> dist.ProcessGroup:
        """A process group of ``members`` with the pipeline's timeout (collective over the world)."""
        group = dist.new_group(members, timeout=self.timeout)
        assert group is not None
        return group

    def global_rank(self, pipeline_rank: int, replica: Optional[int] = None) -> int:
        """The global rank of ``pipeline_rank`` in ``replica`` (default: this rank's)."""
        return (self.replica if replica is None else replica) * self.ranks + pipeline_rank

    def create_groups(self, routes: list[tuple[int, int, str]], rank_of: Any) -> None:
        """Creates the data-parallel groups and one channel per route and direction.

        Every rank calls this with the same ``routes`` (``(from stage, to
        stage, name)``): ``new_group`` is collective over the whole world.
        """
        if self.data_parallel > 1:
            for p in range(self.ranks):
                members = [self.global_rank(p, r) for r in range(self.data_parallel)]
                group = self.new_group(members)
                if p == self.pipeline_rank:
                    self.data_parallel_group = group
        for replica in range(self.data_parallel):
            for src, dst, name in routes:
                for kind, (a, b) in (("act", (src, dst)), ("grad", (dst, src))):
                    rank_a, rank_b = rank_of(a), rank_of(b)
                    channel_group: Optional[dist.ProcessGroup] = None
                    if rank_a != rank_b:
                        members = sorted({self.global_rank(rank_a, replica), self.global_rank(rank_b, replica)})
                        channel_group = self.new_group(members)
                    if replica != self.replica:
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

    Raises:
        ValueError: naming the first field that differs, with each rank's value.
    """
    require_initialized()
    configs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(configs, config)
    for key in config:
        values = [c.get(key) if isinstance(c, dict) else None for c in configs]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"ranks disagree on {key} ({per_rank}); every rank must build the pipeline with the "
                f"same arguments (pass the same {key} on every rank)"
            )
