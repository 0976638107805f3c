"""Costs: what one micro-batch costs on a stage, in seconds and in counted bytes.

The planner compares plans it has not run, so it needs, for any stage (a
contiguous range of layers) and micro-batch size, how long the forward, the
backward and the recomputation take, and how many bytes the stage holds.
:class:`Costs` answers both: times are per layer, added up over a cut's stages
into its :class:`~pipe.core.stage_costs.StageCosts` (:meth:`Costs.stage_costs`,
the one per-stage time type every simulation of a schedule reads); bytes are
per stage, from a function that counts them (measured by
:func:`pipe.plan.profile.profile_costs`, or from tables).

Parameter memory (weights, gradients and optimiser state) is static:
``param_scale`` times the parameter bytes, 2 for SGD, 3 with momentum, 4 for Adam.

:meth:`Costs.from_table` builds the same object from numbers, for tests and
for what-if questions without a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from pipe.core.message import HEADER_BYTES
from pipe.core.stage_costs import StageCosts
from pipe.plan.host_copy import HostCopy
from pipe.recompute.defaults import DEFAULT_SELECT

if TYPE_CHECKING:
    from pipe.balance.timing import LayerTimes

__all__: list[str] = []



@dataclass(frozen=True)
class StageMemory:
    """Counted bytes of one micro-batch on one stage (above what existed before it).

    Attributes:
        forward_peak: high-water mark during the forward (the received input included).
        kept: live after the forward until its backward: what backward needs
            (all activations, or only the input when checkpointed) and the output.
        backward_peak: high-water mark during the backward above the bytes
            live before it (``kept`` excluded): the received gradient, the
            recomputed activations, gradient temporaries.
        after_input: for a backward split into I and W (counted with
            ``split=True``), the bytes above ``kept`` that stay from I until
            W: the gradients recorded at the branch nodes, the replayed graph
            of a checkpointed cell.
        weight_peak: for a split backward, the high-water mark during W above
            the bytes live before it: each weight's new gradient before it is
            added to ``.grad``, and W's own temporaries.
        fetched: for an offloading stage counted with every unit copied back before
            its backward (``prefetch=-1``, as ``DistributedPipe`` does an action ahead),
            the bytes those copies take; ``backward_peak`` is then above ``kept + fetched``.
        reduces: for a stage FSDP gathers a layer at a time and reduces after each
            backward (``blocks="micro-batch"``), the backward's bytes (above those of
            ``backward_peak``) in order: ``(0, peak)`` between two reduces, ``(layer bytes,
            bytes)`` as a layer's reduce-scatter input is allocated, then ``(0, peak)`` to
            the end (:class:`pipe.plan.block_gathers.BlockGathers`); empty if not counted.
    """

    forward_peak: int
    kept: int
    backward_peak: int
    after_input: int = 0
    weight_peak: int = 0
    fetched: int = 0
    reduces: tuple[tuple[int, int], ...] = ()


MemoryFn = Callable[..., StageMemory]
"""``memory(first, stop, rows, checkpointed, recomputed, split, fresh, selected[, offloaded, prefetch][,
blocks=])``: see :class:`Costs`."""


class Costs:
    """Per-layer times and per-stage counted memory at the micro-batch sizes planned for.

    Args:
        batch: samples per mini-batch.
        forward, backward: ``{micro-batch rows: seconds per layer}``.
        memory: ``memory(first, stop, rows, checkpointed, recomputed, split, fresh, selected)``:
            the :class:`StageMemory` of layers ``first:stop`` for a micro-batch of
            ``rows`` samples, the cell checkpointed or not, its first
            ``recomputed`` layers marked for recompute (:func:`pipe.recompute.recompute`),
            its backward split into I and W or not; ``fresh``: the backward creates the
            parameters' gradients (none before it: FSDP's unsharded gradients at a stage's
            first backward of the step), so its peak includes those created; ``selected``:
            its layers from ``recomputed`` up to ``selected`` marked for selective recompute
            (:func:`pipe.recompute.select_recompute` with the ``select`` names; 0: none);
            ``offloaded`` and ``prefetch`` (passed only when ``offloaded`` is not 0): its first
            ``offloaded`` layers offload what they save to host memory (:func:`pipe.recompute.offload`,
            one unit per layer, each unit copied back ``prefetch`` units ahead of its backward, 0: when
            used, -1: all of them before the backward), never together with recompute marks;
            ``blocks`` (passed only when not ``""``): FSDP gathers the stage a layer at a time
            (``Shard(unit="block")``), its gradients reduced once a step (``"step"``) or after each
            backward (``"micro-batch"``), and the gathered layers (and those gradients) count in the peaks.
        param_bytes: bytes of each layer's parameters.
        tied: the parameters held by several layers (tied weights: a GPT-2's embedding and
            head), each as ``(the layers holding it, its bytes)``: ``param_bytes`` counts it in
            each of them, a rank holding several of them holds it once (:meth:`params_of`).
        param_scale: copies of the parameters training keeps (weights, gradients,
            optimiser state).
        output_bytes: ``{rows: bytes of each layer's output}``, for transfer times.
        grad_bytes: ``{rows: bytes of the tensors of each layer's output that need a
            gradient}``: the gradient a stage sends back (default: ``output_bytes``).
        input_grad, weight_grad: ``{rows: seconds per layer}`` of the input-gradient and the
            weight-gradient halves of each backward run apart, for the zero-bubble schedules
            (default: half of it each; ``weight_grad`` alone: the rest of the backward).
        replay: ``{rows: seconds per layer}`` that marking a layer for recompute adds to its
            step (its forward again, and the checkpoint's own work; default: its forward).
        select_replay: ``{rows: seconds per layer}`` that marking a layer for selective
            recompute with the ``select`` names adds to its step (``inf``: it cannot be
            so marked); None: selective recompute was not measured, and is not planned.
        select: the name regexes of :func:`pipe.recompute.select_recompute` that
            ``select_replay`` and ``memory`` were measured with.
        offload_bytes, offload_copies: ``{rows: per layer}``, the bytes an offloader moves to host
            memory (and back) for the layer, and in how many copies (each storage it saves once).
        host_copy: what those copies cost on the profiled device (:mod:`pipe.plan.host_copy`);
            None (the CPU, or not measured): offload is not planned.
        checkpoint_overhead: seconds that a checkpointed cell adds to its step beyond
            its layers' forwards again, whatever its size: the checkpoint's own work per
            call (keeping the random state, guarding the input, its autograd functions),
            measured on one stage's cell (default: none).

    How these become a step time (messages, overhead per action, contention)
    is :class:`pipe.plan.timing.TimeModel`'s part.
    """

    def __init__(self, batch: int, forward: dict[int, list[float]], backward: dict[int, list[float]],
                 memory: MemoryFn, param_bytes: Sequence[int], *, param_scale: float = 2.0,
                 output_bytes: Optional[dict[int, list[int]]] = None,
                 grad_bytes: Optional[dict[int, list[int]]] = None,
                 input_grad: Optional[dict[int, list[float]]] = None,
                 weight_grad: Optional[dict[int, list[float]]] = None,
                 replay: Optional[dict[int, list[float]]] = None,
                 select_replay: Optional[dict[int, list[float]]] = None, select: Sequence[str] = (),
                 tied: Sequence[tuple[Sequence[int], int]] = (),
                 checkpoint_overhead: float = 0.0, offload_bytes: Optional[dict[int, list[int]]] = None,
                 offload_copies: Optional[dict[int, list[int]]] = None,
                 host_copy: Optional[HostCopy] = None) -> None:
        self.batch = batch
        self.forward = forward
        self.backward = backward
        self.input_grad = input_grad or {rows: [b / 2 for b in times] for rows, times in backward.items()}
        self.weight_grad = weight_grad or {rows: [max(b - i, 0.0) for b, i in zip(times, self.input_grad[rows])]
                                           for rows, times in backward.items()}
        self.replay = replay or forward
        self.select_replay = select_replay
        self.checkpoint_overhead = checkpoint_overhead
        self.offload_bytes = offload_bytes
        self.offload_copies = offload_copies or ({rows: [1] * len(b) for rows, b in offload_bytes.items()}
                                                 if offload_bytes is not None else None)
        self.host_copy = host_copy
        self.select = tuple(select)
        if select_replay is not None and not self.select:
            raise ValueError("select_replay needs select=, the name regexes its layers were marked with")
        self._memory = memory
        self._memory_cache: dict[tuple[int, int, int, bool, int, bool, bool, int, int, int, str], StageMemory] = {}
        self.param_bytes = list(param_bytes)
        self.tied = [(tuple(layers), int(nbytes)) for layers, nbytes in tied]
        self.param_scale = param_scale
        self.output_bytes = output_bytes or {}
        self.grad_bytes = grad_bytes or self.output_bytes
        self._replicas: dict[int, "Costs"] = {}  # pipe.plan.sharding.replica_costs: the costs of B / dp_shard
        self._orders: dict[Any, Any] = {}  # pipe.plan.predict: the "auto" order of each candidate and time model
        tables: list[tuple[int, Sequence[float]]] = [
            *forward.items(), *backward.items(), *self.input_grad.items(), *self.weight_grad.items(),
            *self.replay.items(), *(select_replay or {}).items(), *(offload_bytes or {}).items(),
            *(self.offload_copies or {}).items()]
        for rows, times in tables:
            if len(times) != len(self.param_bytes):
                raise ValueError(f"costs at {rows} rows have {len(times)} layers but param_bytes has "
                                 f"{len(self.param_bytes)}; give every table one entry per layer")

    @property
    def layers(self) -> int:
        return len(self.param_bytes)

    @property
    def offloads(self) -> bool:
        """Whether offload can be planned: the bytes each layer moves and the device's host copy were measured."""
        return self.offload_bytes is not None and self.host_copy is not None

    def chunk_options(self) -> list[int]:
        """The micro-batch counts that costs were measured for."""
        return sorted(self.batch // rows for rows in self.forward)

    def rows(self, chunks: int) -> int:
        rows = self.batch // chunks
        if chunks < 1 or rows * chunks != self.batch or rows not in self.forward:
            raise ValueError(
                f"no costs for chunks={chunks} (batch {self.batch}); measured chunk counts are "
                f"{self.chunk_options()}: profile with chunks={chunks} too"
            )
        return rows

    def stage_costs(self, bounds: Sequence[tuple[int, int]], chunks: int, recomputed: Sequence[int] = (),
                    selected: Sequence[int] = (), offloaded: Sequence[int] = (), *,
                    message: Optional[Callable[[int], float]] = None, overhead: float = 0.0,
                    phases: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)) -> StageCosts:
        """The :class:`~pipe.core.stage_costs.StageCosts` of the stages ``bounds`` (``(first, stop)`` layers of
        each) for one micro-batch of ``chunks``: F, B, I, W and R of each, its messages (``message(bytes)``
        seconds each, a link's :meth:`~pipe.plan.timing.Link.cost`; free without it) and ``overhead`` seconds
        per action. Per stage (one entry each, or none: 0),
        ``recomputed``: its first layers replayed in backward (marked for recompute); ``selected``: its
        layers from there up to this count replayed in part (marked for selective recompute);
        ``offloaded``: its first layers offloading to host memory.

        A backward includes the replay of the layers marked for recompute; R is a checkpointed cell's
        replay: the stage's forward and the checkpoint's own work (:attr:`checkpoint_overhead`). On the
        first stage, whose input (the mini-batch) needs no gradient, I is only the replay and W the plain
        backward, as :class:`pipe.core.iw_backward.IWBackward` runs it. An offloading stage's copies run
        on one side stream beside its compute: the copies out start once its first layer's forward has
        saved something, and its first layer's backward waits for the last copy back, so a forward takes
        at least ``forward[first] + copies out`` and a backward at least ``copies back + backward[first]``
        (:meth:`offload_seconds`). ``phases``: each layer's forward (and replay), input gradient, weight
        gradient and whole backward scaled by these (:attr:`pipe.plan.TimeModel.phases`); the checkpoint's
        own work and the copies are not.
        """
        rows = self.rows(chunks)
        times = [self._stage(first, stop, rows, chunks, recomputed[s] if recomputed else 0,
                             selected[s] if selected else 0, offloaded[s] if offloaded else 0, phases)
                 for s, (first, stop) in enumerate(bounds)]
        sent: list[float] = []
        back: list[float] = []
        sizes, grads = self.output_bytes.get(rows, []), self.grad_bytes.get(rows, [])
        for _, stop in bounds[:-1]:  # the message across the boundary after layer stop - 1
            sent.append(message(HEADER_BYTES + sizes[stop - 1]) if message is not None and sizes else 0.0)
            back.append(message(HEADER_BYTES + grads[stop - 1]) if message is not None and sizes else 0.0)
        f, b, r, i, w = (tuple(column) for column in zip(*times))
        return StageCosts(f, i, w, b, tuple(sent), (1.0,) * len(bounds), overhead, r, tuple(back))

    def _stage(self, first: int, stop: int, rows: int, chunks: int, recomputed: int, selected: int,
               offloaded: int, phases: tuple[float, float, float, float]) -> tuple[float, float, float, float, float]:
        """``(F, B, R, I, W)`` of layers ``first:stop`` (:meth:`stage_costs`)."""
        f, i, w, b = phases
        forward = f * math.fsum(self.forward[rows][first:stop])
        replay = math.fsum(self.replay[rows][first:first + recomputed])
        if self.selective(recomputed, selected):
            assert self.select_replay is not None
            replay += math.fsum(self.select_replay[rows][first + recomputed:first + selected])
        replay *= f
        backward = b * math.fsum(self.backward[rows][first:stop])
        recompute = forward + self.checkpoint_overhead  # when the cell is checkpointed
        if offloaded:
            copies = self.offload_seconds(first, first + offloaded, chunks)
            forward = max(forward, f * self.forward[rows][first] + copies)
            backward = max(backward, copies + b * self.backward[rows][first])
        if first == 0:  # the mini-batch needs no gradient: I has no input to reach, W is the whole backward
            return forward, backward + replay, recompute, replay, backward
        input_grad = i * math.fsum(self.input_grad[rows][first:stop])
        weight_grad = w * math.fsum(self.weight_grad[rows][first:stop])
        return forward, backward + replay, recompute, input_grad + replay, weight_grad

    def offload_seconds(self, first: int, stop: int, chunks: int) -> float:
        """Seconds of the host copies one way (out in forward, or back in backward) of layers ``first:stop``
        offloading a micro-batch.

        Raises:
            ValueError: offload was not measured (:attr:`offloads`).
        """
        if self.offload_bytes is None or self.offload_copies is None or self.host_copy is None:
            raise ValueError("these costs did not measure offload (the bytes each layer moves and the device's copy "
                             "to host memory): profile on a CUDA device with pipe.plan.profile_costs(device=...)")
        rows = self.rows(chunks)
        return self.host_copy.seconds(sum(self.offload_bytes[rows][first:stop]),
                                      sum(self.offload_copies[rows][first:stop]))

    def selective(self, recomputed: int, selected: int) -> bool:
        """Whether a stage whose first ``recomputed`` layers recompute fully has layers marked for
        selective recompute (up to ``selected``).

        Raises:
            ValueError: it has, but these costs did not measure selective recompute.
        """
        if selected <= recomputed:
            return False
        if self.select_replay is None:
            raise ValueError(f"selected={selected} marks layers for selective recompute, but these costs did not "
                             f"measure it: profile with pipe.plan.profile_costs(select=[...name regexes])")
        return True

    def stage_memory(self, first: int, stop: int, chunks: int, checkpointed: bool, recomputed: int = 0,
                     split: bool = False, fresh: bool = False, selected: int = 0, offloaded: int = 0,
                     prefetch: int = 1, blocks: str = "") -> StageMemory:
        """Counted bytes of one micro-batch on layers ``first:stop`` (the first ``recomputed`` marked,
        the next up to ``selected`` marked for selective recompute; ``split``: the backward run as
        I then W; ``fresh``: the backward creates the gradients; the first ``offloaded`` offloading:
        the bytes left on the device, and its backward's peak with the units copied back ``prefetch``
        units ahead, 0: as each is used, -1: all before the backward, :attr:`StageMemory.fetched`; ``blocks``:
        FSDP gathers the stage a layer at a time, ``"step"`` or ``"micro-batch"`` its ``Shard(reduce=...)``).

        Counted at the smallest and the largest micro-batch (once, then cached)
        and interpolated in between: activations grow linearly with the rows. An offloading stage
        is counted at its own size: the offloader leaves tensors under its ``min_bytes`` on the device.
        """
        rows = self.rows(chunks)
        # A checkpointed cell replays all of it anyway.
        selected = selected if not checkpointed and self.selective(recomputed, selected) else 0
        recomputed = 0 if checkpointed else recomputed
        offloaded = 0 if checkpointed else offloaded
        if offloaded and (recomputed or selected):
            raise ValueError(f"layers {first}:{stop} both offload ({offloaded}) and recompute ({recomputed}, "
                             f"selectively up to {selected}); the planner plans one or the other on a stage")
        low, high = min(self.forward), max(self.forward)
        prefetch = prefetch if offloaded else 1
        if rows in (low, high) or offloaded:  # what an offloader leaves is not linear in the rows (min_bytes)
            return self._counted(first, stop, rows, checkpointed, recomputed, split, fresh, selected, offloaded,
                                 prefetch, blocks)
        a, b = (self._counted(first, stop, r, checkpointed, recomputed, split, fresh, selected, offloaded, prefetch,
                              blocks) for r in (low, high))
        share = (rows - low) / (high - low)
        # The same layers reduce in the same order at every size: each point interpolated alike.
        reduces = tuple((n, round(x + (y - x) * share)) for (n, x), (_, y) in zip(a.reduces, b.reduces))
        forward_peak, kept, backward_peak, after_input, weight_peak, fetched = (
            round(x + (y - x) * share) for x, y in zip(
                (a.forward_peak, a.kept, a.backward_peak, a.after_input, a.weight_peak, a.fetched),
                (b.forward_peak, b.kept, b.backward_peak, b.after_input, b.weight_peak, b.fetched)))
        return StageMemory(forward_peak, kept, backward_peak, after_input, weight_peak, fetched, reduces)

    def _counted(self, first: int, stop: int, rows: int, checkpointed: bool, recomputed: int,
                 split: bool, fresh: bool = False, selected: int = 0, offloaded: int = 0,
                 prefetch: int = 1, blocks: str = "") -> StageMemory:
        key = (first, stop, rows, checkpointed, recomputed, split, fresh, selected, offloaded, prefetch, blocks)
        if key not in self._memory_cache:
            extra: dict[str, Any] = {"blocks": blocks} if blocks else {}
            self._memory_cache[key] = self._memory(*key[:-1], **extra) if offloaded else self._memory(*key[:-3],
                                                                                                     **extra)
        return self._memory_cache[key]

    def params_of(self, layers: Iterable[int]) -> int:
        """Bytes of the parameters of ``layers`` held together (a tied weight once)."""
        held = set(layers)
        total = sum(self.param_bytes[k] for k in held)
        return total - sum(nbytes * (len(held.intersection(owners)) - 1) for owners, nbytes in self.tied
                           if len(held.intersection(owners)) > 1)

    def static_bytes(self, first: int, stop: int) -> int:
        """Parameters, gradients and optimiser state of layers ``first:stop`` (a tied weight once)."""
        return int(self.param_scale * self.params_of(range(first, stop)))

    @classmethod
    def from_layer_times(cls, times: "LayerTimes", chunks: int) -> "Costs":
        """The costs of ``times``, one micro-batch of ``chunks`` timed (:func:`pipe.balance.time_layers` with
        ``split=True``, on one micro-batch size): for planning without a memory budget
        (:func:`pipe.plan.auto_schedule`). No memory was counted: a stage holds its layers' output bytes per
        micro-batch (what a cost-shaped order weighs a cell by), and parameters are not counted.

        Raises:
            ValueError: ``times`` holds several micro-batch sizes, or no input/weight-gradient halves.
        """
        if len(times.forward) != 1:
            raise ValueError(f"the layer times hold micro-batches of {sorted(times.forward)} rows; give the times "
                             f"of the one micro-batch size planned for")
        rows = next(iter(times.forward))
        if rows < 1:
            raise ValueError(f"the layer times are keyed by {rows} rows; key them by the micro-batch's rows "
                             f"(time_layers(module, {{rows: micro_batch}}, ...))")
        if rows not in times.input_grad or rows not in times.weight_grad:
            raise ValueError(f"the layer times have no input/weight-gradient halves at {rows} rows; "
                             f"measure them with time_layers(..., split=True) on a micro-batch of {rows} rows")
        layers = len(times.forward[rows])
        outputs = times.output_bytes.get(rows, [0] * layers)

        def memory(first: int, stop: int, rows: int, checkpointed: bool, recomputed: int, split: bool,
                   fresh: bool = False, selected: int = 0, blocks: str = "") -> StageMemory:
            held = sum(outputs[first:stop])  # no parameters counted: nothing gathered either
            return StageMemory(forward_peak=held, kept=held, backward_peak=0)

        return cls(rows * chunks, {rows: list(times.forward[rows])}, {rows: list(times.backward[rows])}, memory,
                   [0] * layers, output_bytes={rows: list(outputs)},
                   grad_bytes={rows: list(times.grad_bytes[rows])} if rows in times.grad_bytes else None,
                   input_grad={rows: list(times.input_grad[rows])}, weight_grad={rows: list(times.weight_grad[rows])},
                   replay={rows: list(times.replay[rows])} if rows in times.replay else None)

    @classmethod
    def from_table(cls, batch: int, forward: Sequence[float], backward: Sequence[float],
                   activation: Sequence[int], output: Sequence[int], *, param_bytes: Optional[Sequence[int]] = None,
                   chunks: Sequence[int] = (1, 2, 4, 8), overhead: float = 0.0, param_scale: float = 2.0,
                   select_activation: Optional[Sequence[int]] = None, select_replay: Optional[Sequence[float]] = None,
                   select: Sequence[str] = DEFAULT_SELECT, host_copy: Optional[HostCopy] = None) -> "Costs":
        """Costs from numbers per layer and per sample (no model is run).

        Args:
            batch: samples per mini-batch.
            forward, backward: seconds per sample of each layer.
            activation: bytes per sample each layer keeps for backward (its output included).
            output: bytes per sample of each layer's output.
            param_bytes: bytes of each layer's parameters (default 0).
            chunks: the micro-batch counts to plan for.
            overhead: seconds per layer and micro-batch, whatever its size
                (what makes many small micro-batches slower).
            select_activation, select_replay: bytes per sample each layer keeps,
                and seconds per sample its replay adds, marked for selective
                recompute (with the name regexes ``select``); both or neither
                (then selective recompute is not planned).
            host_copy: the device's copy to host memory: offload is planned, each
                offloading layer moving its ``activation`` bytes in one copy each way.

        A checkpointed stage keeps its input and output; its backward peak is
        the recomputed activations plus one output-sized gradient. A layer
        marked for recompute keeps only its output (the next layer's input);
        one marked selectively keeps its ``select_activation``; either replays
        the rest of its activation in its own backward. An offloading layer keeps
        nothing on the device; in backward its activation and the one prefetched
        (with ``prefetch``) come back. Gathered a layer at a time by FSDP (``blocks``), a stage
        also holds twice its largest layer's parameters in each peak, and reducing after each
        backward its gradients two of its largest layer's at a time (not all at once), and after
        its first backward (``fresh``) its first layer's gradients' copy for their reduce-scatter.
        """
        n = len(forward)
        if (select_activation is None) != (select_replay is None):
            raise ValueError("give select_activation and select_replay together (selective recompute's bytes "
                             "kept and seconds added per sample), or neither")
        tables = {"backward": backward, "activation": activation, "output": output,
                  "select_activation": select_activation or activation, "select_replay": select_replay or forward}
        for name, table in tables.items():
            if len(table) != n:
                raise ValueError(f"{name} has {len(table)} layers but forward has {n}; give one entry per layer")
        chosen = select_activation or activation
        rows_of = {batch // c: c for c in chunks if batch % c == 0}

        def memory(first: int, stop: int, rows: int, checkpointed: bool, recomputed: int,
                   split: bool, fresh: bool = False, selected: int = 0, offloaded: int = 0,
                   prefetch: int = 1, blocks: str = "") -> StageMemory:
            largest = max(param_bytes[first:stop], default=0) if param_bytes else 0  # one weight's new gradient
            # Gathered a layer at a time: a layer and the next one's gather (or its own, being copied out); reduced
            # after each backward, one layer's gradients and their copy for the reduce-scatter at a time.
            gathered = 2 * largest if blocks else 0
            received = output[first - 1] * rows if first > 0 else 0
            full = sum(activation[first:stop]) * rows
            if offloaded:  # the offloaded layers' activations are on the host until their unit comes back
                gone = first + min(offloaded, stop - first)
                kept = received + sum(activation[gone:stop]) * rows
                grads = sum(param_bytes[first:stop]) if fresh and param_bytes else 0
                if prefetch < 0:  # all back before the backward
                    return StageMemory(forward_peak=received + full, kept=kept, backward_peak=output[stop - 1] * rows
                                       + grads, fetched=sum(activation[first:gone]) * rows)
                back = max(activation[k] + (activation[k - 1] if prefetch and k > first else 0)
                           for k in range(first, gone)) * rows
                return StageMemory(forward_peak=received + full, kept=kept,
                                   backward_peak=output[stop - 1] * rows + back + grads,
                                   after_input=0, weight_peak=0)
            marked = first + min(recomputed, stop - first)
            partly = max(marked, first + min(selected, stop - first))
            kept_layers = (sum(output[first:marked]) + sum(chosen[marked:partly]) + sum(activation[partly:stop])) * rows
            out = output[stop - 1] * rows
            kept = received + (out if checkpointed else kept_layers)
            replayed = max([activation[k] for k in range(first, marked)]
                           + [activation[k] - chosen[k] for k in range(marked, partly)], default=0) * rows
            grads = sum(param_bytes[first:stop]) if fresh and param_bytes else 0  # all at once: the safe side
            if blocks == "micro-batch":  # and after the stage's first backward, the copy of its first layer's kept
                grads = 2 * largest + (0 if fresh else next((b for b in (param_bytes or [])[first:stop] if b), 0))
            return StageMemory(forward_peak=received + full + gathered, kept=kept,
                               backward_peak=out + (full - out if checkpointed else replayed) + grads + gathered,
                               after_input=(full - out if checkpointed else 0) + out if split else 0,
                               weight_peak=max(largest, grads) if split else 0)

        return cls(batch,
                   {rows: [overhead + t * rows for t in forward] for rows in rows_of},
                   {rows: [overhead + t * rows for t in backward] for rows in rows_of},
                   memory, param_bytes or [0] * n, param_scale=param_scale,
                   output_bytes={rows: [o * rows for o in output] for rows in rows_of},
                   select_replay={rows: [t * rows for t in select_replay] for rows in rows_of}
                   if select_replay is not None else None, select=select if select_replay is not None else (),
                   offload_bytes={rows: [a * rows for a in activation] for rows in rows_of}
                   if host_copy is not None else None, host_copy=host_copy)
