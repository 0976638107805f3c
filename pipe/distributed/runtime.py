"""The process runner: executes this rank's lowered program (:mod:`pipe.core.lowering`) by step kind.

What this runner shares with the thread runner (:mod:`pipe.threads.pipeline`):
the schedule tables of :mod:`pipe.core.schedule`, micro-batches
(:mod:`pipe.core.microbatch`) and the recipe of a cell
(:func:`pipe.core.checkpoint.cell`: checkpointed or not, ``Checkpoint`` then
``Recompute`` wired ahead of the gradient). What differs: how a tensor moves
(a point-to-point message here, a stream copy there); who drives backward
(this rank's program runs each ``B`` itself, while the thread runner leaves
backward to autograd, or to its workers on the CPU); the schedules (the
thread runner runs GPipe only); how skips travel (extra cell outputs and
messages here, portals there) and how random state is kept (one thread per
rank here, guards between worker threads there). A rank's compute program
(``Schedule(kind, ranks, microbatches, virtual_stages).actions(rank)``) is
lowered into every step the rank takes (receives posted and waited for,
sends, recomputation, FSDP gathers and reduces, offload, the replicas'
averages), and :meth:`Runtime.run` executes those steps in order. The
compute steps::

    F i@s   input  <- scatter (first stage) or message on the "act" channel from s-1
            output -> message to s+1, or loss_fn(output, target) on the last stage
    B i@s   grad   <- message on the "grad" channel from s+1, or d(loss)/d(loss) on the last
            torch.autograd.backward(output, grad); input.grad -> message to s-1
            (a checkpointed cell recomputes first, while its gradient is still on the way)
    I i@s   as B, but only the input gradient; the graph stays for W (zero-bubble
            schedules, :mod:`pipe.core.iw_backward`; a checkpointed cell recomputes here, once)
    W i@s   the weight gradients of the cell, from the graph I kept; then it is freed

While action k computes, the receives of action k+1's messages are already
posted (the lowering puts them there) (the header, and on gloo the tensors of the layout it had last step,
behind the header when they are small), and sends complete in the background
(see :mod:`pipe.distributed.transport`).

Skip connections (:mod:`pipe.skip`) between non-adjacent stages travel the
same way: a stage that stashes a skip popped on another stage returns it as
part of its output (so ``Checkpoint``/``Recompute`` treat it as any output),
and it goes straight to the popping stage on a channel of its own, its
gradient coming back on the paired channel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from pipe import trace
from pipe.core.checkpoint import Checkpointing, cell
from pipe.core.inplace import InputGuard, describe_partition
from pipe.core.iw_backward import IWBackward, backward_input_first
from pipe.core.threadstate import without_autocast
from pipe.distributed.data_parallel import GradientAverager
from pipe.distributed.failure import Failures
from pipe.distributed.fsdp import ENTERED, StageSharding
from pipe.distributed.group import Topology
from pipe.distributed.loss import LossFn, micro_batch_loss, reported_loss
from pipe.distributed.recompute_ranks import RankSwap
from pipe.distributed.stage_function import StageSkips, count_tensors, skip_routes, stage_function
from pipe.distributed.tensor_parallel import tp_submesh
from pipe.distributed.transport import Incoming, Transport
from pipe.core.microbatch import Batch
from pipe.core.lowering import MAIN, TRACE_KINDS, Kind, Step, lower
from pipe.core.schedule import Schedule

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class _Cell:
    """What a forward keeps for its backward."""

    input: Batch
    output: Batch
    input_parts: list[int]  # tensors per input part: main value, then each arriving skip
    output_parts: list[int]  # tensors per output part: main value, then each leaving skip
    loss: Optional[Tensor] = None
    record: Optional[Checkpointing] = None  # a checkpointed cell, when the schedule splits backwards
    split: Optional[IWBackward] = None  # between its I and its W


@dataclass
class _Step:
    """One step's inputs, and what its lowered program has made so far."""

    batches: Optional[list[Batch]]
    targets: Optional[list[Batch]]
    loss_fn: Optional[LossFn]
    checkpoint_stop: int
    weights: Optional[list[float]]
    training: bool
    cells: dict[tuple[int, int], _Cell] = field(default_factory=dict)
    posted: dict[tuple[int, int, str, str], Incoming] = field(default_factory=dict)
    inbox: dict[tuple[int, int, str, str], Any] = field(default_factory=dict)  # (i, s, direction, channel)
    outbox: dict[tuple[int, int, str, str], Any] = field(default_factory=dict)
    outputs: dict[int, Batch] = field(default_factory=dict)
    loss: Optional[Tensor] = None


Executor = Callable[[Step], None]


class Runtime:
    """Runs this rank's lowered program (:mod:`pipe.core.lowering`) one step at a time, by step kind.

    The runtime executes compute, messages and recomputation itself; each
    feature present contributes its own steps' executors (``executors()``):
    FSDP's gathers, reduces and reshards (:class:`~pipe.distributed.fsdp.StageSharding`),
    the replicas' averages (:class:`~pipe.distributed.data_parallel.GradientAverager`),
    offload and prefetch (:class:`~pipe.distributed.recompute_ranks.RankSwap`).

    Args:
        stages: this rank's stages by stage index.
        schedule: the schedule kind, ranks, micro-batches and virtual stages.
        topology: ranks, replicas and channels.
        transport: the point-to-point transport.
        skips: per stage, the skips that cross stages.
        averager: averages gradients over the replicas, or None.
        sharding: gathers, reduces and reshards FSDP stages (:mod:`pipe.distributed.fsdp`), or None.
        swap: offload and prefetch of the recompute config's swap policies, or None.
    """

    def __init__(self, stages: dict[int, nn.Sequential], schedule: Schedule, topology: Topology,
                 transport: Transport, skips: list[StageSkips], averager: Optional[GradientAverager] = None,
                 sharding: Optional[StageSharding] = None, swap: Optional[RankSwap] = None) -> None:
        self.stages = stages
        self.schedule = schedule
        self.topology = topology
        self.transport = transport
        self.skips = skips
        self.averager = averager
        self.sharding = sharding
        self.swap = swap if swap else None
        self.last = schedule.stages - 1
        tp_mesh = tp_submesh(topology.mesh)  # DTensors between stages travel as local shards
        self.functions = {s: stage_function(partition, skips[s], tp_mesh, first=s == 0, last=s == self.last)
                          for s, partition in stages.items()}
        self.input_guards = {s: InputGuard(describe_partition(s, partition, "stage"), shared=s == 0,
                                           partition=partition) for s, partition in stages.items()}
        self.routes = skip_routes(skips)
        self.failures = Failures(topology.rank, topology.world, topology.timeout.total_seconds())
        self.executors: dict[Kind, Executor] = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward, Kind.INPUT: self._backward,
            Kind.WEIGHT: self._weight, Kind.RECOMPUTE: self._recompute, Kind.POST_RECV: self._post,
            Kind.WAIT_RECV: self._wait, Kind.SEND: self._send, Kind.FLUSH: lambda step: self.transport.flush(),
        }
        for feature in (sharding, averager, self.swap):
            if feature is not None:
                self.executors.update({kind: _traced(kind, run) for kind, run in feature.executors().items()})
        if sharding is not None:  # told of each forward, replay and backward (the blocks kept gathered across)
            for kind in ENTERED:
                self.executors[kind] = _entered(sharding.entering, self.executors[kind])
        self._lowered: dict[tuple[bool, int, bool], list[Step]] = {}
        self._step: Optional[_Step] = None

    def lowered(self, training: bool, checkpoint_stop: int, reduce: bool = True) -> list[Step]:
        """This rank's lowered program for a step (made once per mode and kept); ``reduce``: as for :func:`lower`."""
        key = (training, checkpoint_stop if training else 0, reduce or not training)
        if key not in self._lowered:
            swap = self.swap
            rank = self.topology.pipeline_rank
            self._lowered[key] = lower(
                self.schedule.actions(rank), self.routes, training=training, post_ahead=self.schedule.post_ahead(rank),
                checkpoint_stop=key[1],
                zero3=None if self.sharding is None else self.sharding.config.reshard_after_forward,
                offload_stages=() if swap is None else swap.offloading_stages(),
                offload_horizon=0 if swap is None else swap.horizon,
                replicated=self.averager is not None, reduce=key[2])
        return self._lowered[key]

    # -- one step ----------------------------------------------------------------------------

    def run(self, batches: Optional[list[Batch]], targets: Optional[list[Batch]], loss_fn: Optional[LossFn],
            checkpoint_stop: int, weights: Optional[list[float]], training: bool,
            reduce: bool = True) -> tuple[Optional[Tensor], list[Batch]]:
        """Runs the lowered program of this rank for one mini-batch.

        Args:
            batches: the input micro-batches (on the rank of the first stage).
            targets: the target micro-batches (on the rank of the last stage, when training or
                evaluating a loss forwards only).
            loss_fn: ``loss_fn(output, target)`` -> scalar (on the rank of the last stage).
            checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.
            weights: per micro-batch, the factor of its loss in the step's loss.
            training: run backward (True) or forwards only.
            reduce: reduce the gradients over the data-parallel ranks after the
                backwards (False: they accumulate locally, for a later step to reduce).

        Returns:
            ``(loss, outputs)``: the step's loss on the last stage's rank (when
            training, or forwards only with targets), and the last stage's
            output micro-batches (forwards only).
        """
        self.failures.begin_step()
        state = self._step = _Step(batches, targets, loss_fn, checkpoint_stop, weights, training)
        step: Optional[Step] = None
        executors = self.executors
        try:
            if training:
                self.failures.require_same("accumulate", not reduce)
            program = self.lowered(training, checkpoint_stop, reduce)
            if self.sharding is not None:
                self.sharding.begin_step(training, program)
            for step in program:
                executors[step.kind](step)
        except BaseException as error:
            where = "the end of the step" if step is None or step.kind in (Kind.FLUSH, Kind.FINISH_REPLICAS) \
                else str(step.action)
            failure = self.failures.failure_from(where, error)  # published first: the partners wait for it
            if self.sharding is not None:
                self.sharding.abandon()
            raise failure from None
        finally:
            self._step = None
            self.failures.end_step()
        return state.loss, [state.outputs[i] for i in sorted(state.outputs)]

    # -- messages ---------------------------------------------------------------------------

    def _post(self, step: Step) -> None:
        i, s = step.microbatch, step.stage
        channel = self.topology.incoming(s, step.peer, step.direction, step.channel)
        self._state.posted[(i, s, step.direction, step.channel)] = self.transport.receive(channel, i, (i, s))

    def _wait(self, step: Step) -> None:
        key = (step.microbatch, step.stage, step.direction, step.channel)
        state = self._state
        state.inbox[key] = state.posted.pop(key).wait()

    def _send(self, step: Step) -> None:
        i, s = step.microbatch, step.stage
        value = self._state.outbox.pop((i, s, step.direction, step.channel))
        self.transport.send(value, self.topology.outgoing(s, step.peer, step.direction, step.channel), i, (i, s))

    @property
    def _state(self) -> _Step:
        assert self._step is not None, "an executor ran outside Runtime.run"
        return self._step

    # -- forward ----------------------------------------------------------------------------

    def _forward(self, step: Step) -> None:
        state = self._state
        i, s = step.microbatch, step.stage
        skips = self.skips[s]
        checkpoint, training = i < state.checkpoint_stop, state.training
        if s == 0:
            if state.batches is None:
                raise ValueError("the rank of the first stage got no inputs; pass inputs= to step() on that rank")
            main = state.batches[i].value
        else:
            main = state.inbox.pop((i, s, "act", MAIN))
        value = main
        input_parts = [count_tensors(main)]
        if skips.arriving:
            arriving = tuple(state.inbox.pop((i, s, "act", name)) for _, _, name in skips.arriving)
            value = (main, arriving)
            input_parts += [count_tensors(v) for v in arriving]
        batch = kept = Batch(value)
        # A split backward (zero bubble) replays a checkpointed cell in I itself, without the
        # finalize that wires boundary offload; the front end refuses checkpoint_swap there.
        offload = self.swap.checkpoint_hooks(s) if self.swap and checkpoint and training else None
        if offload is not None:
            batch, kept = self.swap.tap(batch)  # type: ignore[union-attr]
        compute, finalize, record = cell(self.functions[s], batch, checkpoint and training, (i, s), offload,
                                         guard=self.input_guards[s])
        del batch  # the offloaded input must not stay referenced here
        with trace.span("forward", (i, s)):  # the last stage's loss is its forward's too (its cost, in a trace)
            output = compute()
            if not self.schedule.splits_backward:  # split: I replays a checkpointed cell itself
                finalize(output)
            main_out = output.value
            output_parts = [count_tensors(main_out)]
            if skips.leaving:
                main_out, leaving = output.value
                output_parts = [count_tensors(main_out)] + [count_tensors(v) for v in leaving]
                for (_, _, name), skip in zip(skips.leaving, leaving):
                    state.outbox[(i, s, "act", name)] = skip
            if s < self.last:
                state.outbox[(i, s, "act", MAIN)] = main_out
            if training:
                state.cells[(i, s)] = _Cell(kept, output, input_parts, output_parts, record=record)
            if s == self.last:
                self._loss(i, Batch(main_out) if skips.leaving else output)

    def _loss(self, i: int, output: Batch) -> None:
        """The last stage's output: its loss (scaled by its weight in the step's) or, forwards only, kept."""
        state = self._state
        targets, loss_fn, weights = state.targets, state.loss_fn, state.weights
        if state.training:
            assert targets is not None and loss_fn is not None and weights is not None
            micro_loss = micro_batch_loss(loss_fn, output.value, targets[i].value, i)
            state.cells[(i, self.last)].loss = micro_loss
            scaled = reported_loss(micro_loss.detach()) * weights[i]
            del micro_loss  # its cell holds it: its graph goes with the cell's W (or B)
        else:
            state.outputs[i] = output
            if loss_fn is None or targets is None or weights is None:
                return
            scaled = reported_loss(micro_batch_loss(loss_fn, output.value, targets[i].value, i)) * weights[i]  # eval
        state.loss = scaled if state.loss is None else state.loss + scaled

    # -- backward ---------------------------------------------------------------------------

    def _recompute(self, step: Step) -> None:
        """Replays a checkpointed cell's forward while its gradient is still on the way."""
        record = self._state.cells[(step.microbatch, step.stage)].record
        if record is not None:
            record.recompute_ahead()

    def _weight(self, step: Step) -> None:
        i, s = step.microbatch, step.stage
        state = self._state.cells.pop((i, s))
        assert state.split is not None  # the schedule runs I before W (validated)
        with trace.span("weight", (i, s)):
            with without_autocast():
                state.split.backward_weight()
        # Its output's graph was kept for W (I retains it): drop the last reference now, not when
        # the next B or W rebinds the name (that held one micro-batch's activations one W longer).
        del state

    def _backward(self, step: Step) -> None:
        """B (the whole backward; the cell is let go) or I (input gradients; the graph stays for W)."""
        i, s = step.microbatch, step.stage
        skips, run = self.skips[s], self._state
        split = step.kind is Kind.INPUT
        state = run.cells[(i, s)] if split else run.cells.pop((i, s))
        if s == self.last:
            assert state.loss is not None and run.weights is not None
            roots, grads = [state.loss * run.weights[i]], None
        else:
            received: list[Optional[Tensor]] = list(run.inbox.pop((i, s, "grad", MAIN)))
            for _, _, name in skips.leaving:
                received += list(run.inbox.pop((i, s, "grad", name)))
            if len(received) != sum(state.output_parts):
                raise RuntimeError(
                    f"stage {s} got {len(received)} gradients for micro-batch {i} but its output holds "
                    f"{sum(state.output_parts)} tensors; the ranks run different models"
                )
            pairs = [(t, g) for t, g in zip(state.output.tensors, received) if g is not None and t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        # Backward outside autocast, as the plain model's; a replay restores its forward's (pipe.core.threadstate).
        if split:
            with without_autocast():
                input_grads = self._input_gradients(i, s, state, roots, grads)
        else:
            if roots:
                with without_autocast():
                    torch.autograd.backward(roots, grads)
            input_grads = [t.grad if t.requires_grad else None for t in state.input.tensors] if s else []
        input_parts = state.input_parts
        del state  # a B's cell goes now (an I's stays in the step's cells for its W)
        if s == 0:
            return
        parts = _split(input_grads, input_parts)
        run.outbox[(i, s, "grad", MAIN)] = parts[0]
        for (_, _, name), part in zip(skips.arriving, parts[1:]):
            run.outbox[(i, s, "grad", name)] = part

    def _input_gradients(self, i: int, s: int, state: _Cell, roots: list[Tensor],
                         grads: Optional[list[Tensor]]) -> list[Optional[Tensor]]:
        """I: the input gradients of the cell; the graph (recomputed once if checkpointed) waits for W."""
        outputs = state.output.tensors
        aligned: list[Optional[Tensor]] = [None] * len(outputs)
        if grads is not None:
            by_id = {id(t): g for t, g in zip(roots, grads)}
            aligned = [by_id.get(id(t)) for t in outputs]
        loss = roots[0] if s == self.last else None
        state.split, _ = backward_input_first(outputs, aligned, state.input.tensors, list(self.stages[s].parameters()),
                                    state.record, loss)
        state.record = None
        with trace.span("input", (i, s)):
            return state.split.backward_input()


def _traced(kind: Kind, run: Executor) -> Executor:
    """``run`` inside a :mod:`pipe.trace` span named as the plans name the step (a gather, a reduce)."""
    name = TRACE_KINDS.get(kind)
    if name is None:
        return run

    def traced(step: Step) -> None:
        with trace.span(name, (step.microbatch, step.stage)):
            run(step)

    return traced


def _entered(entering: Executor, run: Executor) -> Executor:
    """``run``, after ``entering`` is told of the step."""
    def entered(step: Step) -> None:
        entering(step)
        run(step)

    return entered


def _split(items: list[Any], sizes: list[int]) -> list[list[Any]]:
    parts, start = [], 0
    for size in sizes:
        parts.append(items[start:start + size])
        start += size
    return parts
