"""The thread pipeline: runs a schedule's clock cycles over partitions with workers and streams.

Each partition runs its forwards in the order of its program in the schedule
(:meth:`pipe.core.schedule.Schedule.actions`), one clock cycle after the same
micro-batch left the partition before it. For GPipe (m=3 micro-batches over
n=2 partitions) that gives the fill-drain cycles::

    clock  0      1      2      3
    p0    (0,0)  (1,0)  (2,0)
    p1           (0,1)  (1,1)  (2,1)

For each cycle it first *fences* the cells (fork/join edges so that backward
visits micro-batches in order, and stream copies between devices), then
*computes* them: each cell goes to its partition's worker thread, the caller
collects the outputs and finalises them (wiring recomputation for
checkpointed cells). What one run shares across its cycles (the
micro-batches, streams, seeds, skip trackers, the backward pass of the
workers) is one :class:`_Step`, built once per :meth:`Pipeline.run`.

Each run is one call (:mod:`pipe.threads.call`): its tasks report to it alone,
and it cancels and waits for them before it returns or raises, so an
interrupted or failed run leaves nothing behind for the next one.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence, cast

import torch
from torch import nn

from pipe import trace
from pipe.core.checkpoint import Checkpointing, cell
from pipe.core.copy import copy, wait
from pipe.core.dependency import depend
from pipe.core.inplace import InputGuard, describe_partition
from pipe.core.microbatch import Batch
from pipe.core.rng import GeneratorLocks, RandomnessGuard, cell_seed, draw_base_seed
from pipe.core.action import Phase
from pipe.core.schedule import Schedule
from pipe.core.stream import AbstractStream, current_stream, new_stream, use_device
from pipe.skip.layout import SkipLayout
from pipe.skip.tracker import SkipTrackerThroughPortals, partition_function
from pipe.threads.call import Call
from pipe.threads.worker import ExcInfo, Task, Workers
from pipe.threads.backward_pass import BackwardPass
from pipe.threads.worker_backward import CellBackward

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """What one :meth:`Pipeline.run` shares across its clock cycles; built once per run.

    Attributes:
        call: the run's call; its tasks report to it (:mod:`pipe.threads.call`).
        batches: the micro-batches; ``batches[i]`` holds micro-batch i's latest output.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.
        copy_streams: ``copy_streams[j][i]``, the stream micro-batch i arrives on at partition j.
        compute_streams: each partition's compute stream.
        skip_trackers: one per micro-batch, where its stashes and pops meet (:mod:`pipe.skip`); None without skips.
        backward_pass: the workers' backward of this run (CPU partitions), or None for autograd's own.
        base_seed: the seed of each cell's random stream derives from it; None with one micro-batch.
        locks: the generator locks of this run (:class:`pipe.core.rng.GeneratorLocks`).
        training: the model's mode during the run.
    """

    call: Call
    batches: list[Batch]
    checkpoint_stop: int
    copy_streams: list[list[AbstractStream]]
    compute_streams: list[AbstractStream]
    skip_trackers: Optional[list[SkipTrackerThroughPortals]]
    backward_pass: Optional[BackwardPass]
    base_seed: Optional[int]
    locks: GeneratorLocks
    training: bool

    def seed(self, i: int, j: int) -> Optional[int]:
        """The seed of cell (i, j)'s random stream, or None to draw from the global generator."""
        return None if self.base_seed is None else cell_seed(self.base_seed, i, j)


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
            step = self._step(call, batches, checkpoint_stop)
            for cells in clock_cycles(len(self.partitions), len(batches)):
                self._fence(step, cells)
                self._compute(step, cells)
        finally:
            # Normally, by an exception or by an interrupt: nothing of this call runs after it.
            self.workers.end_call(call)

    def _step(self, call: Call, batches: list[Batch], checkpoint_stop: int) -> _Step:
        backward_pass = None
        if self.worker_backward and torch.is_grad_enabled() and not any(self.checkpoint_offload):
            # Gradients for the inputs leave the pipeline: partition 0's jobs must then finish in backward.
            inputs_need_grad = any(t.requires_grad for batch in batches for t in batch.tensors)
            backward_pass = BackwardPass(self.workers.submit, sync_first=inputs_need_grad)
        return _Step(
            call=call, batches=batches, checkpoint_stop=checkpoint_stop,
            copy_streams=self.copy_streams(len(batches)),
            compute_streams=[current_stream(device) for device in self.devices],
            skip_trackers=None if self.skip_layout is None else [
                SkipTrackerThroughPortals(self.skip_layout) for _ in batches],
            backward_pass=backward_pass,
            # With several micro-batches, cells run concurrently: each draws from its
            # own stream, seeded from one draw of the global generator (see pipe.core.rng).
            # One micro-batch runs cell after cell and draws as the plain module does.
            base_seed=draw_base_seed() if len(batches) > 1 else None,
            # A run inside a cell of another pipeline gets its own random-number locks (see pipe.core.rng).
            locks=GeneratorLocks.for_call(),
            training=self.training,
        )

    def _fence(self, step: _Step, cells: list[tuple[int, int]]) -> None:
        batches, copy_streams = step.batches, step.copy_streams
        for i, j in cells:
            # In backward, micro-batch i leaves partition j before micro-batch i-1 does.
            if i != 0:
                depend(batches[i - 1], batches[i])
            if step.skip_trackers is not None and self._receives_skips[j]:
                # Skips popped here come straight from the stash partition's device.
                for prev_j, ns, name in self.skip_layout.arriving(j):  # type: ignore[union-attr]
                    if self.devices[prev_j] != self.devices[j]:
                        step.skip_trackers[i].copy(batches[i], copy_streams[prev_j][i], copy_streams[j][i], ns, name)
            if self._crosses(j):
                with trace.span("copy", (i, j)):
                    copy(batches[i], copy_streams[j - 1][i], copy_streams[j][i])

    def _compute(self, step: _Step, cells: list[tuple[int, int]]) -> None:
        """Runs the cells of one clock cycle on the workers, then wires their outputs in the caller.

        One micro-batch i on partition j, as autograd sees it once its cell ran
        (forward from left to right; backward visits the numbers in reverse)::

            lane i-1:  ... partition j ──(1) Fork──> to partition j+1         (its fence, this cycle)
                                              │ phony
            lane i:    from partition j-1 ──(2) Join──(3) Copy, Wait──(4) Wait──(5) partition j──
                                                   copy streams j-1 -> j    copy -> compute stream j

                       ──(5) partition j──(6) Wait──(7) Join <- Recompute──(8) Boundary──> batches[i]
                         Checkpoint if i <      compute ->   checkpointed      CPU partitions:
                         checkpoint_stop        copy stream  cells             worker backward

        (1)-(3) are the fence (:meth:`_fence`; 3 only between devices), (4)-(8)
        this method. In backward: (8) hands the cell to worker j and returns a
        placeholder (:mod:`pipe.threads.worker_backward`); (7) recomputes the
        cell (:class:`pipe.core.checkpoint.Recompute`) before (5) back-propagates
        through the replayed graph; (4) and (3) bring the gradient back across
        the streams; (2) releases the phony, and only then can (1) let
        micro-batch i-1's gradient into partition j: micro-batches leave a
        partition in reverse order, as in GPipe.
        """
        n = len(self.partitions)
        batches, copy_streams, compute_streams = step.batches, step.copy_streams, step.compute_streams
        # Cells cut out of the caller's graph: (their input there, their backward job).
        cut: dict[tuple[int, int], tuple[Batch, CellBackward]] = {}
        for i, j in cells:
            batch = batches[i]
            if self._crosses(j) or self._receives_skips[j]:
                wait(batch, copy_streams[j][i], compute_streams[j])  # (4)
            if step.backward_pass is not None:
                outer = batch
                batch = batch.with_tensors([t.detach().requires_grad_(t.requires_grad) for t in batch.tensors])
            task, record = self._task(step, i, j, batch)  # (5)
            if step.backward_pass is not None:
                cut[(i, j)] = outer, self._cell_backward(step, i, j, batch, record)
            self.workers.put(j, task)

        failure: Optional[BaseException] = None
        for i, j in cells:
            ok, payload = step.call.get(j)
            if not ok:
                if failure is None:
                    failure = cast(ExcInfo, payload)[1]
                continue
            task, batch = cast(tuple[Task, Batch], payload)
            if (j != n - 1 and self._crosses(j + 1)) or self._sends_skips[j]:
                wait(batch, compute_streams[j], copy_streams[j][i])  # (6)
            with use_device(self.devices[j]):
                task.finalize(batch)  # (7)
            if (i, j) in cut:
                outer, cell_backward = cut[(i, j)]
                params = [p for p in self.partitions[j].parameters() if p.requires_grad]
                batch = cell_backward.connect(outer, batch, params)  # (8)
            batches[i] = batch
        if failure is not None:
            raise failure

    def _task(self, step: _Step, i: int, j: int, batch: Batch) -> tuple[Task, Optional[Checkpointing]]:
        """Cell (i, j) as a task for worker j, and its checkpoint record when it is checkpointed."""
        guard, training, seed, locks = self.guards[j], step.training, step.seed(i, j), step.locks
        skip_tracker = None if step.skip_trackers is None else step.skip_trackers[i]
        # The recipe of a cell is shared with the process runner (pipe.core.checkpoint.cell).
        compute_cell, finalize, record = cell(partition_function(self.partitions[j], skip_tracker), batch,
                                              i < step.checkpoint_stop, (i, j), offload=self.checkpoint_offload[j],
                                              guard=self.input_guards[j])

        def compute() -> Batch:
            # Draws of random numbers must not interleave with those of a
            # checkpointed cell on another thread (see pipe.core.rng).
            with guard.forward(training, seed, locks), trace.span("forward", (i, j)):
                return compute_cell()

        return Task(step.compute_streams[j], compute=compute, finalize=finalize, call=step.call, tag=(i, j)), record

    def _cell_backward(self, step: _Step, i: int, j: int, inner_input: Batch,
                       record: Optional[Checkpointing]) -> CellBackward:
        """The backward job of cell (i, j) for its worker (see pipe.threads.worker_backward)."""
        backward_pass = step.backward_pass
        assert backward_pass is not None  # only called for a run with a worker backward
        guard, training, seed, locks = self.guards[j], step.training, step.seed(i, j), step.locks

        def recompute_ahead(record: Checkpointing) -> None:
            # Replays random state, so it must not interleave with other partitions' draws.
            with guard.forward(training, seed, locks):
                record.recompute_ahead()

        prepare = None if record is None else functools.partial(recompute_ahead, record)
        return CellBackward(backward_pass, j, inner_input, prepare=prepare, sync=j == 0 and backward_pass.sync_first,
                            record=record)


@functools.lru_cache(maxsize=64)
def clock_cycles(partitions: int, chunks: int) -> list[list[tuple[int, int]]]:
    """The (micro-batch, partition) cells of each clock cycle, from each partition's program; cached per shape.

    Partition j runs the forwards of its program (``Schedule.actions(j)``) in
    order; a forward takes the cycle after the partition's previous forward and
    after the same micro-batch's forward on partition j-1. Within a cycle the
    cells are ordered by micro-batch. For GPipe, cell (i, j) runs in cycle i + j.
    """
    schedule = Schedule("gpipe", ranks=partitions, microbatches=chunks)
    cycle_of: dict[tuple[int, int], int] = {}
    for j in range(partitions):
        previous = -1
        for action in schedule.actions(j):
            if action.phase is Phase.FORWARD:
                previous = max(previous, cycle_of.get((action.microbatch, j - 1), -1)) + 1
                cycle_of[(action.microbatch, j)] = previous
    cycles: list[list[tuple[int, int]]] = [[] for _ in range(max(cycle_of.values(), default=-1) + 1)]
    for (i, j), k in sorted(cycle_of.items()):
        cycles[k].append((i, j))
    return cycles
