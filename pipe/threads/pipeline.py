"""The thread pipeline: runs a schedule's clock cycles over partitions with workers and streams.

For each clock cycle of the schedule (:mod:`pipe.core.schedule`; GPipe fill-drain
for m=3 micro-batches over n=2 partitions)::

    clock  0      1      2      3
    p0    (0,0)  (1,0)  (2,0)
    p1           (0,1)  (1,1)  (2,1)

it first *fences* the cells (fork/join edges so that backward visits
micro-batches in order, and stream copies between devices), then *computes*
them: each cell goes to its partition's worker thread, the caller collects
the outputs and finalises them (wiring recomputation for checkpointed cells).

Each run is one call (:mod:`pipe.threads.call`): its tasks report to it alone,
and it cancels and waits for them before it returns or raises, so an
interrupted or failed run leaves nothing behind for the next one.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, ContextManager, Optional, Sequence, cast

import torch
from torch import nn

from pipe import trace
from pipe.threads.worker_backward import BackwardPass, CellBackward
from pipe.core.checkpoint import Checkpointing, cell
from pipe.core.copy import Copy, Wait
from pipe.core.dependency import fork, join
from pipe.core.inplace import InputGuard, describe_partition
from pipe.core.microbatch import Batch
from pipe.core.rng import GeneratorLocks, RandomnessGuard, cell_seed, draw_base_seed
from pipe.core.schedule import Schedule
from pipe.skip.layout import SkipLayout
from pipe.skip.tracker import SkipTracker, SkipTrackerThroughPortals, partition_function
from pipe.core.stream import AbstractStream, current_stream, new_stream, use_device
from pipe.threads.call import Call
from pipe.threads.worker import ExcInfo, Task, Workers

__all__ = ["Pipeline", "depend", "copy", "wait"]

logger = logging.getLogger(__name__)


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Makes ``fork_from``'s backward wait for ``join_to``'s (an edge with no data)."""
    fork_from.tensor, phony = fork(fork_from.tensor)
    join_to.tensor = join(join_to.tensor, phony)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Moves ``batch`` to ``next_stream``'s device on the copy streams."""
    batch.replace_tensors(Copy.apply(prev_stream, next_stream, *batch.tensors))
    wait(batch, prev_stream, next_stream)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Makes ``next_stream`` wait for the work on ``prev_stream`` that produced ``batch``."""
    batch.replace_tensors(Wait.apply(prev_stream, next_stream, *batch.tensors))


class Pipeline:
    """Runs micro-batches through partitions with one worker thread per partition.

    Args:
        partitions: the partitions, each already on its device.
        devices: the device of each partition.
        workers: the worker threads.
        skip_layout: routes of the skip tensors of ``@skippable`` layers
            (:mod:`pipe.skip`); None when the model has none.
    """

    def __init__(self, partitions: Sequence[nn.Sequential], devices: Sequence[torch.device], workers: Workers,
                 skip_layout: Optional[SkipLayout] = None) -> None:
        self.partitions = list(partitions)
        self.devices = list(devices)
        self.workers = workers
        self.skip_layout = skip_layout if skip_layout else None
        # Skips copied between devices: partition j sends some / receives some.
        self._sends_skips = [False] * len(self.devices)
        self._receives_skips = [False] * len(self.devices)
        if self.skip_layout is not None:
            for j in range(len(self.devices)):
                for prev_j, _, _ in self.skip_layout.arriving(j):
                    if self.devices[prev_j] != self.devices[j]:
                        self._sends_skips[prev_j] = self._receives_skips[j] = True
        self.guards = [RandomnessGuard(device) for device in self.devices]
        # Checkpointed partitions that modify their input in place (pipe.core.inplace).
        self.input_guards = [InputGuard(describe_partition(j, p), shared=j == 0, partition=p)
                             for j, p in enumerate(self.partitions)]
        self.training = True
        # Autograd would run the backward of CPU partitions one after another on
        # the caller's thread; their workers run it side by side (pipe.threads.worker_backward).
        # Skips cross partitions outside the cells' inputs and outputs, and
        # offloaded boundary inputs must not stay referenced by the previous
        # cell's job, so those keep autograd's own backward.
        self.worker_backward = (len(self.devices) > 1 and all(d.type == "cpu" for d in self.devices)
                                and self.skip_layout is None)
        # Per partition: where the inputs kept for recomputation wait (pipe.recompute's checkpoint swap).
        self.checkpoint_offload: list[Optional[Callable[[], ContextManager[Any]]]] = [None] * len(self.devices)
        # copy_streams[j][i]: the stream micro-batch i arrives on at partition j.
        self._copy_streams: list[list[AbstractStream]] = [[] for _ in self.devices]

    def copy_streams(self, chunks: int) -> list[list[AbstractStream]]:
        for j, device in enumerate(self.devices):
            streams = self._copy_streams[j]
            while len(streams) < chunks:
                streams.append(new_stream(device))
        return self._copy_streams

    def _crosses(self, j: int) -> bool:
        """Whether micro-batches move to another device between partitions j-1 and j."""
        return j > 0 and self.devices[j - 1] != self.devices[j]

    def run(self, batches: list[Batch], checkpoint_stop: int) -> None:
        """Runs ``batches`` through every partition in place.

        Args:
            batches: input micro-batches; on return each holds its output.
            checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.

        Raises:
            The first exception a layer raised; the pipeline stops at the end of
            that clock cycle and can run again.
            PipeClosedError: ``close()`` was called from another thread meanwhile.
        """
        call = self.workers.open_call()
        try:
            self._run(call, batches, checkpoint_stop)
        finally:
            # Normally, by an exception or by an interrupt: nothing of this call runs after it.
            self.workers.end_call(call)

    def _run(self, call: Call, batches: list[Batch], checkpoint_stop: int) -> None:
        cycles = _forward_clock_cycles(len(self.partitions), len(batches))
        copy_streams = self.copy_streams(len(batches))
        compute_streams = [current_stream(device) for device in self.devices]
        # One skip tracker per micro-batch: its stashes and pops meet there (pipe.skip).
        skip_trackers = None if self.skip_layout is None else [
            SkipTrackerThroughPortals(self.skip_layout) for _ in batches]
        backward_pass = None
        if self.worker_backward and torch.is_grad_enabled() and not any(self.checkpoint_offload):
            # Gradients for the inputs leave the pipeline: partition 0's jobs must then finish in backward.
            inputs_need_grad = any(t.requires_grad for batch in batches for t in batch.tensors)
            backward_pass = BackwardPass(self.workers.submit, sync_first=inputs_need_grad)
        # With several micro-batches, cells run concurrently: each draws from its
        # own stream, seeded from one draw of the global generator (see pipe.core.rng).
        # One micro-batch runs cell after cell and draws as the plain module does.
        base_seed = draw_base_seed() if len(batches) > 1 else None
        # A run inside a cell of another pipeline gets its own random-number locks (see pipe.core.rng).
        locks = GeneratorLocks.for_call()
        for cells in cycles:
            self._fence(batches, cells, copy_streams, skip_trackers)
            self._compute(batches, cells, copy_streams, compute_streams, checkpoint_stop, base_seed, skip_trackers,
                          backward_pass, call=call, locks=locks)

    def _fence(self, batches: list[Batch], cells: list[tuple[int, int]],
               copy_streams: list[list[AbstractStream]],
               skip_trackers: Optional[list[SkipTrackerThroughPortals]] = None) -> None:
        for i, j in cells:
            # In backward, micro-batch i leaves partition j before micro-batch i-1 does.
            if i != 0:
                depend(batches[i - 1], batches[i])
            if skip_trackers is not None and self._receives_skips[j]:
                # Skips popped here come straight from the stash partition's device.
                for prev_j, ns, name in self.skip_layout.arriving(j):  # type: ignore[union-attr]
                    if self.devices[prev_j] != self.devices[j]:
                        skip_trackers[i].copy(batches[i], copy_streams[prev_j][i], copy_streams[j][i], ns, name)
            if self._crosses(j):
                with trace.span("copy", (i, j)):
                    copy(batches[i], copy_streams[j - 1][i], copy_streams[j][i])

    def _compute(self, batches: list[Batch], cells: list[tuple[int, int]],
                 copy_streams: list[list[AbstractStream]], compute_streams: list[AbstractStream],
                 checkpoint_stop: int, base_seed: Optional[int],
                 skip_trackers: Optional[list[SkipTrackerThroughPortals]] = None,
                 backward_pass: Optional[BackwardPass] = None, *, call: Call,
                 locks: GeneratorLocks) -> None:
        n = len(self.partitions)
        # Cells cut out of the caller's graph: (their input there, their backward job).
        cut: dict[tuple[int, int], tuple[Batch, CellBackward]] = {}
        for i, j in cells:
            batch = batches[i]
            partition = self.partitions[j]
            if self._crosses(j) or self._receives_skips[j]:
                wait(batch, copy_streams[j][i], compute_streams[j])
            skip_tracker = None if skip_trackers is None else skip_trackers[i]
            if backward_pass is not None:
                outer = batch
                batch = batch.with_tensors([t.detach().requires_grad_(t.requires_grad) for t in batch.tensors])
            seed = None if base_seed is None else cell_seed(base_seed, i, j)
            task, recomputable = self._task(i, j, batch, partition, compute_streams[j], i < checkpoint_stop,
                                             seed, skip_tracker, call=call, locks=locks)
            if backward_pass is not None:
                cut[(i, j)] = outer, self._cell_backward(backward_pass, i, j, batch, recomputable, seed, locks)
            self.workers.put(j, task)

        failure: Optional[BaseException] = None
        for i, j in cells:
            ok, payload = call.get(j)
            if not ok:
                if failure is None:
                    failure = cast(ExcInfo, payload)[1]
                continue
            task, batch = cast(tuple[Task, Batch], payload)
            if (j != n - 1 and self._crosses(j + 1)) or self._sends_skips[j]:
                wait(batch, compute_streams[j], copy_streams[j][i])
            with use_device(self.devices[j]):
                task.finalize(batch)
            if (i, j) in cut:
                outer, cell_backward = cut[(i, j)]
                params = [p for p in self.partitions[j].parameters() if p.requires_grad]
                batch = cell_backward.connect(outer, batch, params)
            batches[i] = batch
        if failure is not None:
            raise failure

    def _task(self, i: int, j: int, batch: Batch, partition: nn.Sequential, stream: AbstractStream,
              checkpoint: bool, seed: Optional[int],
              skip_tracker: Optional[SkipTracker] = None, *, call: Call,
              locks: GeneratorLocks) -> tuple[Task, Optional[Checkpointing]]:
        guard = self.guards[j]
        training = self.training
        # The recipe of a cell is shared with the process runner (pipe.core.checkpoint.cell).
        compute_cell, finalize, record = cell(partition_function(partition, skip_tracker), batch, checkpoint, (i, j),
                                      offload=self.checkpoint_offload[j], guard=self.input_guards[j])

        def compute() -> Batch:
            # Draws of random numbers must not interleave with those of a
            # checkpointed cell on another thread (see pipe.core.rng).
            with guard.forward(training, seed, locks), trace.span("forward", (i, j)):
                return compute_cell()

        return Task(stream, compute=compute, finalize=finalize, call=call, tag=(i, j)), record

    def _cell_backward(self, backward_pass: BackwardPass, i: int, j: int, inner_input: Batch,
                       record: Optional[Checkpointing], seed: Optional[int],
                       locks: GeneratorLocks) -> CellBackward:
        """The backward job of cell (i, j) for its worker (see pipe.threads.worker_backward)."""
        guard = self.guards[j]
        training = self.training
        def recompute_ahead(record: Checkpointing) -> None:
            # Replays random state, so it must not interleave with other partitions' draws.
            with guard.forward(training, seed, locks):
                record.recompute_ahead()

        prepare = None if record is None else functools.partial(recompute_ahead, record)
        return CellBackward(backward_pass, j, inner_input, prepare=prepare, sync=j == 0 and backward_pass.sync_first,
                            record=record)


@functools.lru_cache(maxsize=64)
def _forward_clock_cycles(partitions: int, chunks: int) -> list[list[tuple[int, int]]]:
    """The (micro-batch, partition) cells of each GPipe clock cycle, cached per shape."""
    schedule = Schedule("gpipe", ranks=partitions, microbatches=chunks)
    return [[(a.microbatch, a.stage) for a in cycle] for cycle in schedule.forward_clock_cycles()]

