"""The process runner: executes this rank's program from :mod:`pipe.core.schedule` with send/recv.

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
rank here, guards between worker threads there). A rank walks its program
(``Schedule(kind, ranks, microbatches, virtual_stages).actions(rank)``)::

    F i@s   input  <- scatter (first stage) or message on the "act" channel from s-1
            output -> message to s+1, or loss_fn(output, target) on the last stage
    B i@s   grad   <- message on the "grad" channel from s+1, or d(loss)/d(loss) on the last
            torch.autograd.backward(output, grad); input.grad -> message to s-1
            (a checkpointed cell recomputes first, while its gradient is still on the way)
    I i@s   as B, but only the input gradient; the graph stays for W (zero-bubble
            schedules, :mod:`pipe.core.iw_backward`; a checkpointed cell recomputes here, once)
    W i@s   the weight gradients of the cell, from the graph I kept; then it is freed

While action k computes, the receives of action k+1's messages are already
posted (the header, and on gloo the tensors of the layout it had last step,
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
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from pipe import trace
from pipe.core.checkpoint import Checkpointing, Function, cell
from pipe.core.inplace import InputGuard, describe_partition
from pipe.core.iw_backward import IWBackward, backward_input_first
from pipe.core.threadstate import without_autocast
from pipe.distributed.data_parallel import GradientAverager
from pipe.distributed.failure import Failures
from pipe.distributed.fsdp import StageSharding
from pipe.distributed.group import Topology
from pipe.distributed.loss import LossFn, micro_batch_loss, reported_loss
from pipe.distributed.recompute_ranks import RankSwap
from pipe.distributed.tensor_parallel import from_wire, tp_submesh, to_wire
from pipe.distributed.transport import Incoming, Transport
from pipe.core.microbatch import Batch, flatten
from pipe.core.schedule import Action, Phase, Schedule
from pipe.skip.layout import SkipLayout
from pipe.skip.namespace import NamespaceOrNone, SkipKey
from pipe.skip.tracker import SkipTracker, partition_function, use_skip_tracker

__all__: list[str] = []

logger = logging.getLogger(__name__)

MAIN = "main"  # the channel name of the activations flowing stage to stage



@dataclass
class StageSkips:
    """The skips that leave or reach one stage, as ``(other stage, key, channel name)``."""

    arriving: list[tuple[int, SkipKey, str]] = field(default_factory=list)
    leaving: list[tuple[int, SkipKey, str]] = field(default_factory=list)

    @staticmethod
    def from_layout(layout: Optional[SkipLayout], stages: int) -> list["StageSkips"]:
        """Per stage, the skips crossing stages; channels are named by route order (same on every rank)."""
        result = [StageSkips() for _ in range(stages)]
        if layout is None:
            return result
        for k, ((ns, name), (src, dst)) in enumerate(layout.routes.items()):
            if src == dst:
                continue
            channel = f"skip{k}:{name}"
            result[src].leaving.append((dst, (ns, name), channel))
            result[dst].arriving.append((src, (ns, name), channel))
        return result


class _CrossStageTracker(SkipTracker):
    """Skips within the stage are handed over as usual; crossing ones come from / go to the runner."""

    def __init__(self, arriving: dict[SkipKey, Optional[Tensor]], leaving: set[SkipKey]) -> None:
        super().__init__()
        self.arriving = arriving
        self.leaving = leaving
        self.outgoing: dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: NamespaceOrNone, name: str, tensor: Optional[Tensor]) -> None:
        if (ns, name) in self.leaving:
            self.outgoing[(ns, name)] = tensor
        else:
            super().save(batch, ns, name, tensor)

    def load(self, batch: Batch, ns: NamespaceOrNone, name: str) -> Optional[Tensor]:
        if (ns, name) in self.arriving:
            return self.arriving[(ns, name)]
        return super().load(batch, ns, name)


def stage_function(partition: nn.Module, skips: StageSkips, tp_mesh: Optional[DeviceMesh] = None,
                   first: bool = True, last: bool = True) -> Function:
    """The function a cell of this stage runs (and a checkpoint replays).

    Without skips crossing the stage it is :func:`pipe.skip.tracker.partition_function`.
    Otherwise the input value is ``(value, arriving skips)`` and the output
    ``(value, leaving skips)``, so skips are ordinary inputs and outputs of the cell.
    With tensor parallelism (``tp_mesh``), every ``DTensor`` a stage sends (its
    value and its skips) crosses ranks as its local shard and is rebuilt on the
    receiving rank's mesh (:mod:`pipe.distributed.tensor_parallel`): the first
    stage's input and the last stage's output stay as they are.
    """
    function = partition_function(partition) if not skips.arriving and not skips.leaving \
        else _with_skips(partition, skips)
    if tp_mesh is None:
        return function

    def wired(batch: Batch) -> Batch:
        output = function(batch if first else Batch(from_wire(batch.value, tp_mesh)))
        return output if last else Batch(to_wire(output.value))

    return wired


def _with_skips(partition: nn.Module, skips: StageSkips) -> Function:
    arriving_keys = [key for _, key, _ in skips.arriving]
    leaving_keys = [key for _, key, _ in skips.leaving]

    def function(batch: Batch) -> Batch:
        value = batch.value
        incoming: dict[SkipKey, Optional[Tensor]] = {}
        if arriving_keys:
            value, skip_values = value
            incoming = dict(zip(arriving_keys, skip_values))
        tracker = _CrossStageTracker(incoming, set(leaving_keys))
        with use_skip_tracker(tracker):
            output = partition(value)
        if leaving_keys:
            missing = [name for ns, name in leaving_keys if (ns, name) not in tracker.outgoing]
            if missing:
                raise RuntimeError(f"skips {missing} are declared but were not stashed in this forward")
            output = (output, tuple(tracker.outgoing[key] for key in leaving_keys))
        return Batch(output)

    return function


def _count_tensors(value: Any) -> int:
    return sum(1 for leaf in flatten(value)[0] if isinstance(leaf, Tensor))


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


class Runtime:
    """Runs this rank's stages for one step at a time.

    Args:
        stages: this rank's stages by stage index.
        schedule: the schedule kind, ranks, micro-batches and virtual stages.
        topology: ranks, replicas and channels.
        transport: the point-to-point transport.
        skips: per stage, the skips that cross stages.
        averager: averages gradients over the replicas, or None.
        sharding: gathers, reduces and reshards FSDP stages (:mod:`pipe.distributed.fsdp`), or None.
    """

    def __init__(self, stages: dict[int, nn.Sequential], schedule: Schedule, topology: Topology,
                 transport: Transport, skips: list[StageSkips], averager: Optional[GradientAverager],
                 sharding: Optional[StageSharding] = None) -> None:
        self.stages = stages
        self.schedule = schedule
        self.topology = topology
        self.transport = transport
        self.skips = skips
        self.averager = averager
        self.sharding = sharding
        self.last = schedule.stages - 1
        tp_mesh = tp_submesh(topology.mesh)  # DTensors between stages travel as local shards
        self.functions = {s: stage_function(partition, skips[s], tp_mesh, first=s == 0, last=s == self.last)
                          for s, partition in stages.items()}
        self.input_guards = {s: InputGuard(describe_partition(s, partition, "stage"), shared=s == 0,
                                           partition=partition) for s, partition in stages.items()}
        # Offload of the recompute/swap config, prefetched from the program (pipe.distributed.recompute_ranks).
        self.swap: Optional[RankSwap] = None
        self.failures = Failures(topology.rank, topology.world, topology.timeout.total_seconds())

    # -- one step ----------------------------------------------------------------------------

    def run(self, batches: Optional[list[Batch]], targets: Optional[list[Batch]], loss_fn: Optional[LossFn],
            checkpoint_stop: int, weights: Optional[list[float]], training: bool) -> tuple[Optional[Tensor], list[Batch]]:
        """Runs the program of this rank for one mini-batch.

        Args:
            batches: the input micro-batches (on the rank of the first stage).
            targets: the target micro-batches (on the rank of the last stage, when training or
                evaluating a loss forwards only).
            loss_fn: ``loss_fn(output, target)`` -> scalar (on the rank of the last stage).
            checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.
            weights: per micro-batch, the factor of its loss in the step's loss.
            training: run backward (True) or forwards only.

        Returns:
            ``(loss, outputs)``: the step's loss on the last stage's rank (when
            training, or forwards only with targets), and the last stage's
            output micro-batches (forwards only).
        """
        self.failures.begin_step()
        program = [a for a in self.schedule.actions(self.topology.pipeline_rank)
                   if training or a.phase is Phase.FORWARD]
        cells: dict[tuple[int, int], _Cell] = {}
        outputs: dict[int, Batch] = {}
        loss: Optional[Tensor] = None
        backwards_left = {s: self.schedule.microbatches for s in self.stages}
        action: Optional[Action] = None
        sharding = self.sharding
        try:
            if sharding is not None:
                sharding.begin_step(program, training)
            posted = self._post(program[0]) if program else {}
            for k, action in enumerate(program):
                if sharding is not None:
                    sharding.before(k, action.stage)  # gathered (and the next stage prefetched)
                if action.phase in (Phase.INPUT, Phase.BACKWARD):  # recompute a checkpointed cell while
                    record = cells[(action.microbatch, action.stage)].record  # its gradient travels
                    if record is not None:
                        record.recompute_ahead()
                messages = {name: incoming.wait() for name, incoming in posted.items()}
                posted = self._post(program[k + 1]) if k + 1 < len(program) else {}
                if self.swap:
                    self.swap.before(program, k)
                i, s = action.microbatch, action.stage
                if action.phase is Phase.FORWARD:
                    output = self._forward(action, batches, messages, cells, i < checkpoint_stop, training)
                    if s == self.last:
                        if training:
                            assert targets is not None and loss_fn is not None and weights is not None
                            micro_loss = micro_batch_loss(loss_fn, output.value, targets[i].value, i)
                            cells[(i, s)].loss = micro_loss
                            scaled = reported_loss(micro_loss.detach()) * weights[i]
                            loss = scaled if loss is None else loss + scaled
                            del micro_loss  # its cell holds it: its graph goes with the cell's W (or B)
                        else:
                            outputs[i] = output
                            if loss_fn is not None and targets is not None and weights is not None:  # eval_step
                                micro_loss = reported_loss(micro_batch_loss(loss_fn, output.value, targets[i].value, i)) * weights[i]
                                loss = micro_loss if loss is None else loss + micro_loss
                    del output  # a small output was copied to its send: free it with its cell
                elif action.phase is Phase.INPUT:
                    self._backward(action, messages, cells[(i, s)], weights)
                else:
                    state = cells.pop((i, s))
                    if action.phase is Phase.WEIGHT:
                        assert state.split is not None  # the schedule runs I before W (validated)
                        with trace.span("weight", (i, s)):
                            with without_autocast():
                                state.split.backward_weight()
                    else:
                        self._backward(action, messages, state, weights)
                    # Its output's graph was kept for W (I retains it): drop the last reference now, not when
                    # the next B or W rebinds the name (that held one micro-batch's activations one W longer).
                    del state
                    backwards_left[s] -= 1
                    if backwards_left[s] == 0 and self.averager is not None:
                        self.averager.start(s)  # overlaps with the backward of this rank's other stages
                if sharding is not None:
                    sharding.after(k)  # the stage's last backward: reduce-scatter once; reshard
            action = None
            self.transport.flush()
            if self.averager is not None and training:
                self.averager.finish()
        except BaseException as error:
            where = str(action) if action is not None else "the end of the step"
            failure = self.failures.failure_from(where, error)  # published first: the partners wait for it
            if sharding is not None:
                sharding.abandon()
            raise failure from None
        return loss, [outputs[i] for i in sorted(outputs)]

    # -- receives ---------------------------------------------------------------------------

    def _post(self, action: Action) -> dict[str, Incoming]:
        """Posts the receives of every message ``action`` needs."""
        i, s = action.microbatch, action.stage
        topology, transport = self.topology, self.transport
        posted: dict[str, Incoming] = {}
        where = (i, s)
        if action.phase is Phase.FORWARD:
            if s > 0:
                posted[MAIN] = transport.receive(topology.incoming(s, s - 1, "act", MAIN), i, where)
            for src, _, name in self.skips[s].arriving:
                posted[name] = transport.receive(topology.incoming(s, src, "act", name), i, where)
        elif action.phase is not Phase.WEIGHT:
            if s < self.last:
                posted[MAIN] = transport.receive(topology.incoming(s, s + 1, "grad", MAIN), i, where)
            for dst, _, name in self.skips[s].leaving:
                posted[name] = transport.receive(topology.incoming(s, dst, "grad", name), i, where)
        return posted

    # -- forward ----------------------------------------------------------------------------

    def _forward(self, action: Action, batches: Optional[list[Batch]], messages: dict[str, Any],
                 cells: dict[tuple[int, int], _Cell], checkpoint: bool, training: bool) -> Batch:
        i, s = action.microbatch, action.stage
        skips = self.skips[s]
        if s == 0:
            if batches is None:
                raise ValueError("the rank of the first stage got no inputs; pass inputs= to step() on that rank")
            main = batches[i].value
        else:
            main = messages[MAIN]
        value = main
        input_parts = [_count_tensors(main)]
        if skips.arriving:
            arriving = tuple(messages[name] for _, _, name in skips.arriving)
            value = (main, arriving)
            input_parts += [_count_tensors(v) for v in arriving]
        batch = kept = Batch(value)
        # A split backward (zero bubble) replays a checkpointed cell in I itself, without the
        # finalize that wires boundary offload; the front end refuses checkpoint_swap there.
        offload = self.swap.checkpoint_hooks(s) if self.swap and checkpoint and training else None
        if offload is not None:
            batch, kept = self.swap.tap(batch)  # type: ignore[union-attr]
        compute, finalize, record = cell(self.functions[s], batch, checkpoint and training, (i, s), offload,
                                         guard=self.input_guards[s])
        del batch  # the offloaded input must not stay referenced here
        with trace.span("forward", (i, s)):
            output = compute()
        if not self.schedule.splits_backward:  # split: I replays a checkpointed cell itself
            finalize(output)

        main_out = output.value
        output_parts = [_count_tensors(main_out)]
        if skips.leaving:
            main_out, leaving = output.value
            output_parts = [_count_tensors(main_out)] + [_count_tensors(v) for v in leaving]
            for (dst, _, name), skip in zip(skips.leaving, leaving):
                self.transport.send(skip, self.topology.outgoing(s, dst, "act", name), i, (i, s))
        if s < self.last:
            self.transport.send(main_out, self.topology.outgoing(s, s + 1, "act", MAIN), i, (i, s))
        if training:
            cells[(i, s)] = _Cell(kept, output, input_parts, output_parts, record=record)
        return Batch(main_out) if skips.leaving else output

    # -- backward ---------------------------------------------------------------------------

    def _backward(self, action: Action, messages: dict[str, Any], state: _Cell,
                  weights: Optional[list[float]]) -> None:
        i, s = action.microbatch, action.stage
        skips = self.skips[s]
        if s == self.last:
            assert state.loss is not None and weights is not None
            roots, grads = [state.loss * weights[i]], None
        else:
            received: list[Optional[Tensor]] = list(messages[MAIN])
            for _, _, name in skips.leaving:
                received += list(messages[name])
            if len(received) != sum(state.output_parts):
                raise RuntimeError(
                    f"stage {s} got {len(received)} gradients for micro-batch {i} but its output holds "
                    f"{sum(state.output_parts)} tensors; the ranks run different models"
                )
            pairs = [(t, g) for t, g in zip(state.output.tensors, received) if g is not None and t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        # Backward outside autocast, as the plain model's; a replay restores its forward's (pipe.core.threadstate).
        if action.phase is Phase.INPUT:
            with without_autocast():
                input_grads = self._input_gradients(action, state, roots, grads)
        elif roots:
            with without_autocast():
                torch.autograd.backward(roots, grads)
        if s == 0:
            return
        if action.phase is not Phase.INPUT:
            input_grads = [t.grad if t.requires_grad else None for t in state.input.tensors]
        parts = _split(input_grads, state.input_parts)
        self.transport.send(parts[0], self.topology.outgoing(s, s - 1, "grad", MAIN), i, (i, s))
        for (src, _, name), part in zip(skips.arriving, parts[1:]):
            self.transport.send(part, self.topology.outgoing(s, src, "grad", name), i, (i, s))


    def _input_gradients(self, action: Action, state: _Cell, roots: list[Tensor],
                         grads: Optional[list[Tensor]]) -> list[Optional[Tensor]]:
        """I: the input gradients of the cell; the graph (recomputed once if checkpointed) waits for W."""
        i, s = action.microbatch, action.stage
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


def _split(items: list[Any], sizes: list[int]) -> list[list[Any]]:
    parts, start = [], 0
    for size in sizes:
        parts.append(items[start:start + size])
        start += size
    return parts
