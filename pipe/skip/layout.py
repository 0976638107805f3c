"""Skip layout: which partition stashes each skip and which pops it.

The layout is the routing table of skip tensors, computed once when a
``Pipe`` or ``DistributedPipe`` is built. The thread pipeline reads it to copy
a skip tensor from the stash partition's device straight to the pop
partition's (:meth:`SkipLayout.arriving`); the process runner turns its
``routes`` into one channel per skip, from the stash stage to the pop stage,
however many stages lie in between (``pipe.distributed.stage_function.StageSkips``).
"""
from __future__ import annotations

from typing import Iterable, Iterator

from torch import nn

from pipe.skip.namespace import NamespaceOrNone, SkipKey
from pipe.skip.skippable import Skippable, skippables_in

__all__: list[str] = []


class SkipLayout:
    """Routes of the skips of a partitioned model.

    Args:
        num_partitions: how many partitions the model has.
        routes: ``{(namespace, name): (stash partition, pop partition)}``.
    """

    def __init__(self, num_partitions: int, routes: dict[SkipKey, tuple[int, int]]) -> None:
        self.num_partitions = num_partitions
        self.routes = dict(routes)
        self._arriving: list[list[tuple[int, NamespaceOrNone, str]]] = [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in self.routes.items():
            if prev_j != next_j:
                self._arriving[next_j].append((prev_j, ns, name))

    def __bool__(self) -> bool:
        return bool(self.routes)

    def __repr__(self) -> str:
        routes = ", ".join(f"{name!r}: {p}->{q}" for (_, name), (p, q) in self.routes.items())
        return f"SkipLayout({self.num_partitions} partitions, {{{routes}}})"

    def crosses_partitions(self, ns: NamespaceOrNone, name: str) -> bool:
        """Whether the skip leaves the partition that stashes it (and so needs a portal)."""
        prev_j, next_j = self.routes[(ns, name)]
        return prev_j != next_j

    def arriving(self, j: int) -> list[tuple[int, NamespaceOrNone, str]]:
        """``(stash partition, namespace, name)`` of the skips popped in ``j`` but stashed elsewhere."""
        return self._arriving[j]


def _skippables(layers: Iterable[nn.Module]) -> Iterator[Skippable]:
    for layer in layers:
        yield from skippables_in(layer)


def inspect_skip_layout(partitions: list[nn.Sequential]) -> SkipLayout:
    """Builds the layout of ``partitions`` (already checked by ``verify_skippables``)."""
    routes: dict[SkipKey, tuple[int, int]] = {}
    stashed_at: dict[SkipKey, int] = {}
    for j, partition in enumerate(partitions):
        for layer in _skippables(partition):
            for key in layer.stashable():
                stashed_at[key] = j
            for key in layer.poppable():
                routes[key] = (stashed_at.pop(key), j)
    return SkipLayout(len(partitions), routes)
