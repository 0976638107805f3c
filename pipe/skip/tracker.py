"""Skip trackers: where a skippable layer puts the tensors it stashes and finds those it pops.

Layers do not know which micro-batch or pipeline they run in, so the tracker
is thread-local state: the pipeline makes one tracker per micro-batch and
installs it (:func:`use_skip_tracker`) around every forward of that
micro-batch, the checkpointed forward and its recomputation included.
Outside a pipeline a thread-local default tracker is used, so a model written
with ``@skippable`` also runs as a plain ``nn.Module``.

Within one partition a skip tensor is handed over as is (autograd sees it);
across partitions it goes through a :class:`~pipe.skip.portal.Portal`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from torch import Tensor, nn

from pipe.core.checkpoint import is_checkpointing, is_recomputing
from pipe.core.dependency import fork, join
from pipe.core.microbatch import Batch
from pipe.skip.namespace import NamespaceOrNone, SkipKey
from pipe.recompute.stats import scratch_running_stats
from pipe.skip.portal import Portal
from pipe.core.stream import AbstractStream

if TYPE_CHECKING:
    from pipe.skip.layout import SkipLayout

__all__: list[str] = []


def _describe(ns: NamespaceOrNone, name: str) -> str:
    return f"{name!r}" if ns is None else f"{name!r} (in {ns!r})"


class SkipTracker:
    """Skip tensors of one forward, handed from stash to pop within one thread of work."""

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: NamespaceOrNone, name: str, tensor: Optional[Tensor]) -> None:
        """Keeps ``tensor`` stashed under ``(ns, name)``; ``batch`` is the stashing layer's output."""
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: NamespaceOrNone, name: str) -> Optional[Tensor]:
        """Takes the tensor stashed under ``(ns, name)``; ``batch`` is the popping layer's input."""
        try:
            return self.tensors.pop((ns, name))
        except KeyError:
            raise RuntimeError(
                f"skip {_describe(ns, name)} is popped but was not stashed before; a layer that "
                "stashes it must run earlier in the same forward (pipe.skip.verify_skippables "
                "checks a model's declarations)"
            ) from None


class SkipTrackerThroughPortals(SkipTracker):
    """The tracker of one micro-batch in a pipeline: skips that leave a partition use portals.

    Args:
        skip_layout: the routes of the model's skips.
    """

    def __init__(self, skip_layout: "SkipLayout") -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: dict[SkipKey, Portal] = {}

    def save(self, batch: Batch, ns: NamespaceOrNone, name: str, tensor: Optional[Tensor]) -> None:
        if not self.skip_layout.crosses_partitions(ns, name):
            super().save(batch, ns, name, tensor)
            return
        portal = self.portals.get((ns, name))
        if portal is None:
            # Checkpointed: the pop partition takes the tensor twice, in its
            # forward and in its recomputation (see Portal.put_tensor).
            portal = Portal(tensor, 3 if is_checkpointing() else 2)
            self.portals[(ns, name)] = portal
        else:
            # Recomputation of the stash partition: the recomputed tensor is
            # taken once, by blue() below, and carries the gradient.
            portal.put_tensor(tensor, 1)
        phony = portal.blue()
        batch.tensor = join(batch.tensor, phony)

    def load(self, batch: Batch, ns: NamespaceOrNone, name: str) -> Optional[Tensor]:
        if not self.skip_layout.crosses_partitions(ns, name):
            return super().load(batch, ns, name)
        portal = self.portals.get((ns, name))
        if portal is None:
            raise RuntimeError(f"skip {_describe(ns, name)} is popped before the partition that stashes it ran")
        batch.tensor, phony = fork(batch.tensor)
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: NamespaceOrNone, name: str) -> None:
        """Moves the skip ``(ns, name)`` to ``next_stream``'s device, tied to ``batch``'s lane."""
        portal = self.portals[(ns, name)]
        batch.tensor, phony = fork(batch.tensor)
        phony = portal.copy(prev_stream, next_stream, phony)
        batch.tensor = join(batch.tensor, phony)


class _Local(threading.local):
    def __init__(self) -> None:
        self.tracker: Optional[SkipTracker] = None


_local = _Local()


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Makes ``tracker`` the one skippable layers in this thread use, for the body."""
    orig = _local.tracker
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = orig


def current_skip_tracker() -> SkipTracker:
    """The tracker installed in this thread, or the thread's default one."""
    tracker = _local.tracker
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


def partition_function(partition: nn.Module, skip_tracker: Optional[SkipTracker] = None) -> Callable[[Batch], Batch]:
    """The function a checkpoint replays: the partition applied to a batch (both runners use it).

    With a skip tracker, the partition's skippable layers stash into and pop
    from it, in the first forward and in the recomputation alike. While
    recomputing, train-mode batch norms update scratch copies of their running
    statistics (:mod:`pipe.recompute.stats`), so a checkpointed micro-batch
    moves them once, as the plain model does.
    """
    def function(batch: Batch) -> Batch:
        with scratch_running_stats(partition if is_recomputing() else None):
            if skip_tracker is None:
                return batch.call(partition)
            with use_skip_tracker(skip_tracker):
                return batch.call(partition)

    return function
