"""Splitting ranks between pipeline and FSDP sharding: ``pp x dp_shard`` candidates, their memory and time.

``DistributedPipe(..., mesh=make_mesh(pp=P, dp_shard=S), shard=Shard(...))``
runs P pipeline ranks, each stage sharded over S ranks with FSDP2, and its
runner (:class:`pipe.distributed.fsdp.StageSharding`) drives the gathers: a
stage is gathered before its first action of the step (the next action's
stage prefetched), kept gathered within a run of its actions, resharded when
the program moves on (ZeRO-3, ``reshard_after_forward=True``) or after its
last action (ZeRO-2), and its gradients are reduce-scattered once, after its
last backward. The planner follows the very same per-action plan
(:func:`pipe.core.lowering.gathers`):

* **batch**: each of the S pipelines of a shard group gets B/S of the
  mini-batch, so chunks c at ``dp_shard`` S run micro-batches of B/(S*c)
  rows: the profile measured for chunks S*c (:func:`replica_costs`; no new
  profiling, but S*c must be among the profiled chunk counts);
* **memory** (:func:`sharded_static`, :func:`held_by_fsdp`): parameters,
  gradients and optimiser state sharded (``param_scale x params / S``), plus
  what the step holds unsharded on top of the activations: the full
  parameters of each stage while gathered, a prefetch in flight (its gathered
  buffer), and each stage's full gradients from its first
  backward (``B``, or ``W`` in zero-bubble schedules) to its reduce-scatter;
* **time** (:func:`collective_seconds`): one all-gather per gather and one
  reduce-scatter per step of each FSDP group (each layer with parameters),
  ``(S - 1) x (latency + collective_overhead + group bytes / S x (per_byte + collective_per_byte))``
  over the link (a ring), plus ``shard_step_overhead`` per sharded stage and
  step, added to the action before which (after which, for the
  reduce-scatter) the runner issues it; both overheads are measured with the
  link (:func:`pipe.plan.link.measure_link`, on 2 ranks). The overlap of
  prefetches with compute is not modelled, nor how ranks that outnumber the cores slow the
  collectives (their compute shares the cores: :class:`pipe.plan.timing.TimeModel` ``cores``).

Under ZeRO-3 FSDP may gather a layer at a time instead (``Shard(unit="block")``, the
candidate's ``unit``): the layers gathered are counted inside each action, where
the stage's layers run with FSDP's gathers added around each layer's forward
and backward (``Costs.stage_memory(blocks=...)``), its full gradients held as
above (``reduce="step"``) or, reduced after each backward
(``reduce="micro-batch"``), created and freed within it; every layer is
gathered for each forward and each backward (and a checkpointed cell's replay)
and reduce-scattered once a step or after each backward.

Replicas (``make_mesh(pp=P, dp_replicate=R)``, R pipelines holding full
copies) split the batch the same way. Without sharding the runner's averager
(:class:`pipe.distributed.data_parallel.GradientAverager`) copies a stage's
gradients into flat buffers after its last backward, all-reduces them
asynchronously and keeps them until the step ends: the planner counts those
copies (:func:`held_by_averager`) and charges the averaging, per bucket, to
that last backward: a ring over R ranks scaled from the average measured
between 2 ranks with the link (:meth:`pipe.plan.timing.Link.all_reduce`:
copies, all-reduce, division). With ``dp_shard`` S as well (HSDP) FSDP
all-reduces each reduce-scattered shard over the R replicas, in place: the
memory is that of ``dp_shard`` S, but for one thing. Reducing a layer at a time
after each backward, FSDP keeps the all-reduced shard of each layer until the
layer's next reduce frees it, or the stage's reduce at the step's end (the
one is a buffer of its own beside the shard's ``.grad``): from a stage's first
backward on, a rank holds about a second gradient shard of the stage
(:func:`backward_peak_with_shards` inside that stage's backwards, ``Held.during``
elsewhere). The planner counts the ``.grad`` as existing when the step starts
(zeroed in place, ``zero_grad(set_to_none=False)``); set to None instead, the
first backward's shard becomes the ``.grad`` itself, and a stage with one or
two micro-batches a step holds up to that gradient shard less than counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from pipe.core.lowering import gather_events
from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.options import REDUCES, UNITS, checkpoint_stop
from pipe.core.units import format_bytes
from pipe.plan.cost import Costs, StageMemory

if TYPE_CHECKING:  # pragma: no cover
    from pipe.plan.candidate import Candidate
    from pipe.plan.predict import Prediction
    from pipe.plan.timing import Link

__all__: list[str] = []

#: ``reshard_after_forward`` of ``pipe.distributed.Shard`` by ZeRO stage.
ZERO_MODES: dict[int, bool] = {3: True, 2: False}


#: Bytes of gradients the averager copies into one flat buffer (its bucket, as DDP's).
BUCKET_BYTES = 25 * 1024 * 1024


def divisor_splits(ranks: int) -> list[int]:
    """The sizes that divide ``ranks`` (``pp x dp_shard``, or ``pp x dp_replicate``): every divisor."""
    return [s for s in range(1, ranks + 1) if ranks % s == 0]


def replica_costs(costs: Costs, parts: int, label: str = "") -> Costs:
    """The costs one pipeline of a shard or replica group sees: the same profile, on B / ``parts`` samples.

    ``parts`` is ``dp_replicate x dp_shard``; chunks c then mean micro-batches of B/(parts*c) rows, the rows
    profiled for chunks ``parts*c``; counted bytes are shared with ``costs`` (cached once). ``label`` names the
    split in errors (default ``dp_shard=<parts>``).

    Raises:
        ValueError: the batch does not divide by ``parts``, or no profiled
            micro-batch size fits (the message names the chunk counts to profile).
    """
    if parts == 1:
        return costs
    cache = costs._replicas
    if parts in cache:
        return cache[parts]
    label = label or f"dp_shard={parts}"
    if costs.batch % parts:
        raise ValueError(f"{label} does not divide the mini-batch of {costs.batch} samples: each pipeline takes "
                         f"batch / {parts} of it; choose a batch that divides by {parts}, or leave "
                         f"{label} out of the splits")
    batch = costs.batch // parts
    kept = sorted(rows for rows in costs.forward if batch % rows == 0)
    if not kept:
        raise ValueError(
            f"{label} runs micro-batches of {batch} / chunks samples, but the profile has none of "
            f"them (profiled chunk counts {costs.chunk_options()}); profile with chunks that include "
            f"{[parts * c for c in range(1, batch + 1) if batch % c == 0][:3]} (chunks c at {label} is the "
            f"profile of chunks {parts}*c)")
    view = Costs(batch, {r: costs.forward[r] for r in kept}, {r: costs.backward[r] for r in kept},
                 costs._memory, costs.param_bytes, param_scale=costs.param_scale,
                 output_bytes={r: b for r, b in costs.output_bytes.items() if r in kept},
                 grad_bytes={r: b for r, b in costs.grad_bytes.items() if r in kept},
                 input_grad={r: costs.input_grad[r] for r in kept}, weight_grad={r: costs.weight_grad[r] for r in kept},
                 replay={r: costs.replay[r] for r in kept},
                 select_replay={r: costs.select_replay[r] for r in kept} if costs.select_replay is not None else None,
                 select=costs.select, tied=costs.tied,
                 checkpoint_overhead=costs.checkpoint_overhead,
                 offload_bytes={r: costs.offload_bytes[r] for r in kept} if costs.offload_bytes is not None else None,
                 offload_copies={r: costs.offload_copies[r] for r in kept} if costs.offload_copies is not None else None,
                 host_copy=costs.host_copy)
    view._memory_cache = costs._memory_cache  # keyed by rows: the same counts
    cache[parts] = view
    return view


def _stage_bytes(costs: Costs, bounds: list[tuple[int, int]], stage: int) -> int:
    return costs.params_of(range(*bounds[stage]))


def _first_layer_bytes(costs: Costs, bounds: list[tuple[int, int]], stage: int) -> int:
    """Bytes of the parameters of ``stage``'s first layer that has any."""
    return next((b for b in costs.param_bytes[bounds[stage][0]:bounds[stage][1]] if b), 0)


def sharded_static(costs: Costs, bounds: list[tuple[int, int]], stages: Sequence[int], dp_shard: int) -> int:
    """Bytes of a rank's parameters, gradients and optimiser state between steps: its shards (rounded up)."""
    return sum(-(-int(costs.param_scale * _stage_bytes(costs, bounds, s)) // dp_shard) for s in stages)


def _program(schedule: Schedule, rank: int) -> list[Action]:
    return list(schedule.actions(rank))


@dataclass(frozen=True)
class Held:
    """What FSDP holds on one rank along its program (:func:`held_by_fsdp`).

    Attributes:
        during: bytes held unsharded during each action, activations apart.
        fresh: the actions that create a stage's gradients (its first ``B``, or its first ``W``
            in a zero-bubble schedule): their peak is counted with the gradients created
            (``Costs.stage_memory(fresh=True)``), so ``during`` leaves that stage's gradients out there.
        copied: the actions after which the averager copies their stage's gradients, each with the
            copies held from then on (this stage's and those copied before).
        all_reduced: HSDP reducing a layer at a time after each backward: the stage's backwards, each
            with whether every layer's all-reduced shard is held as it starts (not in the stage's first
            of the step), and the stage's shard bytes (:func:`backward_peak_with_shards`).
    """

    during: list[int]
    fresh: frozenset[int]
    copied: dict[int, int] = field(default_factory=dict)
    all_reduced: dict[int, tuple[bool, int]] = field(default_factory=dict)


def held_by_fsdp(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]], dp_shard: int,
                 zero3: bool, blocks: str = "", dp_replicate: int = 1) -> Held:
    """What FSDP holds unsharded during each action of ``rank``'s program (activations apart).

    Follows the runner's plan (:func:`pipe.core.lowering.gathers`): a
    stage's full parameters from the wait for its gather to its reshard; a
    prefetch issued before action k and waited for before action k + 1 holds
    its gathered buffer (the stage's bytes; the input shard is a view of it) during action k;
    a stage's full gradients from its first backward to the reduce-scatter
    after its last (the first ``B`` or ``W`` of a stage counts those it
    creates in its own peak: each weight's new gradient becomes its
    ``.grad``, where a later one is added to it).

    Gathered a layer at a time (``blocks``, :attr:`pipe.plan.Candidate.blocks`), the layers gathered are
    counted inside each action (``Costs.stage_memory(blocks=...)``), and nothing here but the
    gradients: a stage's full gradients as above (``"step"``); or (``"micro-batch"``: each backward
    creates its layers' gradients and frees them, counted in its own peak) the copy of its first layer's
    gradients for their reduce-scatter, which FSDP keeps from the stage's first backward to its reduce
    (inside the stage's own backwards counted there: ``fresh`` are its first). With replicas
    (``dp_replicate`` > 1) each layer's all-reduced shard too, from its first reduce of the step to the
    stage's reduce (inside the stage's backwards: ``all_reduced``).
    """
    program = _program(schedule, rank)
    events = gather_events(program, zero3, training=True)
    first_grad: dict[int, int] = {}
    for k, action in enumerate(program):
        if action.phase in _gradient_phases(schedule):
            first_grad.setdefault(action.stage, k)
    reduced = {s: k for k, event in enumerate(events) for s in event.reduce}
    if blocks == "micro-batch":
        backwards = {s: [k for k, a in enumerate(program) if a.stage == s and a.phase in _gradient_phases(schedule)]
                     for s in first_grad}
        shards = {s: _stage_shard(costs, bounds, s, dp_shard) if dp_replicate > 1 else 0 for s in first_grad}

        def kept(k: int) -> int:
            # FSDP keeps a stage's last reduce-scatter input, its first layer's, to its reduce; with replicas,
            # the layers' all-reduced shards from the second backward on. A stage's own backwards count theirs.
            total = 0
            for s, ks in backwards.items():
                if k in ks or k > reduced.get(s, len(program)):
                    continue
                total += _first_layer_bytes(costs, bounds, s) if ks[0] < k else 0
                total += shards[s] if ks[0] < k else 0
            return total

        all_reduced = {k: (k != ks[0], shards[s]) for s, ks in backwards.items() if shards[s] for k in ks}
        return Held([kept(k) for k in range(len(program))], frozenset(first_grad.values()), all_reduced=all_reduced)
    if blocks:  # the runner gathers nothing: every parameter of a stage is in a layer FSDP's hooks gather
        events = [replace(event, unshard=[]) for event in events]
    during: list[int] = []
    gathered: set[int] = set()
    fresh = frozenset(first_grad.values())
    for k, action in enumerate(program):
        creates = k in fresh  # this action creates its stage's gradients (counted in its own peak)
        in_flight = [s for s in events[k].unshard if s != action.stage]  # the prefetch, waited for at k + 1
        gathered.update(s for s in events[k].unshard if s == action.stage)
        total = sum(_stage_bytes(costs, bounds, s) for s in gathered)
        total += sum(_stage_bytes(costs, bounds, s) for s in in_flight)  # its input shard is a view of it
        total += sum(_stage_bytes(costs, bounds, s) for s, first in first_grad.items()
                     if first <= k <= reduced.get(s, len(program)) and not (first == k and creates))
        during.append(total)
        gathered.update(in_flight)  # waited for before action k + 1
        gathered.difference_update(events[k].reshard)
    return Held(during, fresh)


def backward_peak_with_shards(memory: StageMemory, dp_shard: int, all_held: bool, stage_shard: int) -> int:
    """The peak of an HSDP stage's backward (FSDP reducing a layer at a time after each) with the layers'
    all-reduced shards FSDP keeps (:attr:`Held.all_reduced`): in the stage's first backward of the step each
    layer's from its reduce on, in a later one all of them but the reducing layer's own, freed just before
    its reduce-scatter input is allocated. From ``memory.reduces``; without them (a table's costs), the
    stage's whole shard, ``stage_shard``, over the backward's peak."""
    if not memory.reduces:
        return memory.backward_peak + stage_shard
    layers = [nbytes for nbytes, _ in memory.reduces if nbytes]
    total = sum(-(-b // dp_shard) for b in layers) if all_held else 0
    peak = 0
    for nbytes, at in memory.reduces:
        shard = -(-nbytes // dp_shard)
        if not nbytes:
            peak = max(peak, at + total)
        elif all_held:
            peak = max(peak, at + total - shard)
        else:
            peak = max(peak, at + total)
            total += shard  # its all-reduced shard, kept from now on
    return peak


def _stage_shard(costs: Costs, bounds: list[tuple[int, int]], stage: int, dp_shard: int) -> int:
    """Bytes of ``stage``'s gradient shard, each layer's rounded up as FSDP pads it."""
    return sum(-(-b // dp_shard) for b in costs.param_bytes[bounds[stage][0]:bounds[stage][1]])


def _gradient_phases(schedule: Schedule) -> tuple[Phase, ...]:
    """The actions that add to a stage's gradients: ``B``, or ``W`` in a zero-bubble schedule."""
    return (Phase.WEIGHT,) if schedule.splits_backward else (Phase.BACKWARD,)


def _last_backwards(schedule: Schedule, program: list[Action]) -> dict[int, int]:
    """Each stage's last action that adds to its gradients: the runner starts its averaging after it."""
    return {action.stage: k for k, action in enumerate(program) if action.phase in _gradient_phases(schedule)}


def held_by_averager(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]]) -> Held:
    """What the replicas' averager holds on one rank along its program (activations apart).

    :class:`pipe.distributed.data_parallel.GradientAverager` copies a stage's
    gradients into flat buffers after the stage's last backward and keeps
    them until the step's end, when the averages are written back: the
    stage's bytes from the end of its last backward on.
    """
    program = _program(schedule, rank)
    last = _last_backwards(schedule, program)

    def copies(k: int) -> int:  # held during action k: the stages whose last backward came before it
        return sum(_stage_bytes(costs, bounds, s) for s, end in last.items() if end < k)

    return Held([copies(k) for k in range(len(program))], frozenset(), {k: copies(k + 1) for k in last.values()})


def _ring(link: "Link", nbytes: int, size: int) -> float:
    """Seconds of FSDP's all-gather or reduce-scatter of ``nbytes`` over a ring of ``size`` ranks: ``size - 1``
    messages of ``nbytes / size``, each with FSDP's overhead per step and per byte."""
    part = -(-nbytes // size)
    return (size - 1) * (link.cost(part) + link.collective_overhead + part * link.collective_per_byte)


def collective_seconds(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]],
                       candidate: "Candidate", link: Optional["Link"]) -> dict[Action, float]:
    """Seconds of the collectives issued before or after each action of ``rank``: FSDP's or the averager's.

    Sharded (``dp_shard`` S): each FSDP group (a layer with parameters) is
    all-gathered and reduce-scattered over a ring of S ranks (S - 1 messages
    of its bytes / S, each with the link's ``collective_overhead`` and
    ``collective_per_byte``), and with
    ``dp_replicate`` R its shard is all-reduced over R ranks too
    (:meth:`pipe.plan.timing.Link.all_reduce`); a stage's reduction adds
    ``shard_step_overhead``. Replicated without sharding: each stage's
    gradients are averaged over R ranks after its last backward, one flat
    buffer per bucket of :data:`BUCKET_BYTES` (copies included, as measured).
    A layer at a time (``candidate.unit == "block"``), each layer is gathered
    for each forward and backward, twice for a checkpointed cell's backward,
    and reduced once a step or after each backward (``candidate.reduce``).
    """
    shard, replicas = candidate.dp_shard, candidate.dp_replicate
    if link is None or shard * replicas == 1:
        return {}
    program = _program(schedule, rank)
    if shard == 1:
        ends = _last_backwards(schedule, program)

        def average(stage: int) -> float:
            buckets, size = [], 0
            for b in costs.param_bytes[bounds[stage][0]:bounds[stage][1]]:
                size += b
                if size >= BUCKET_BYTES:
                    buckets.append(size)
                    size = 0
            return sum(link.all_reduce(b, replicas) for b in buckets + ([size] if size else []))

        return {program[k]: average(s) for s, k in ends.items()}
    def groups(stage: int) -> list[int]:
        return [b for b in costs.param_bytes[bounds[stage][0]:bounds[stage][1]] if b]

    def gather(stage: int) -> float:
        return sum(_ring(link, b, shard) for b in groups(stage))

    def reduce(stage: int) -> float:
        total = sum(_ring(link, b, shard) + link.all_reduce(-(-b // shard), replicas) for b in groups(stage))
        return total + link.shard_step_overhead

    events = gather_events(program, candidate.reshard_after_forward, training=True)
    if not candidate.blocks:
        return {action: sum(gather(s) for s in events[k].unshard) + sum(reduce(s) for s in events[k].reduce)
                for k, action in enumerate(program)}
    # A layer at a time: every layer gathered for each forward, for each backward, and once more for a
    # checkpointed cell's replay; reduced after each backward ("micro-batch", the overhead per step after the
    # stage's last) or once a step. (A layer the runner keeps gathered across two actions is counted twice.)
    stop = checkpoint_stop(candidate.checkpoint, candidate.chunks)
    last = _last_backwards(schedule, program)

    def layered(k: int, action: Action) -> float:
        s = action.stage
        if action.phase is Phase.FORWARD:
            return gather(s)
        total = gather(s) * (2 if action.microbatch < stop else 1)
        if candidate.blocks == "micro-batch":
            total += reduce(s) - (0.0 if last.get(s) == k else link.shard_step_overhead)
        return total + sum(reduce(r) for r in events[k].reduce if candidate.blocks == "step")

    return {action: layered(k, action) for k, action in enumerate(program)}


def split_text(candidate: "Candidate") -> str:
    """``pp2 x dp_shard2 zero3``, ``pp2 x dp_replicate2``, ``pp1 x dp_replicate2 x dp_shard2 zero3``: how the
    candidate splits its ranks."""
    replicas = f" x dp_replicate{candidate.dp_replicate}" if candidate.dp_replicate > 1 else ""
    if candidate.dp_shard == 1:
        return f"pp{candidate.ranks}{replicas}" if replicas else f"pp{candidate.ranks} x dp_shard1"
    blocks = {"": "", "step": " unit=block", "micro-batch": " unit=block reduce=micro-batch"}[candidate.blocks]
    return (f"pp{candidate.ranks}{replicas} x dp_shard{candidate.dp_shard} "
            f"zero{3 if candidate.reshard_after_forward else 2}{blocks}")


DpShard = Union[None, str, int, Sequence[int]]


def shard_sizes(sizes: DpShard, ranks: int, name: str = "dp_shard") -> list[int]:
    """The ``name`` (``dp_shard`` or ``dp_replicate``) sizes to plan ``ranks`` ranks with: ``"auto"`` every
    divisor, or those given; None: 1 alone.

    Raises:
        ValueError: a size that does not divide ``ranks`` (named, with the divisors to choose from).
    """
    divisors = divisor_splits(ranks)
    if sizes is None:
        return [1]
    if sizes == "auto":
        return divisors
    given: list[object] = [sizes] if isinstance(sizes, int) else list(sizes or [])
    found = [s for s in given if isinstance(s, int) and not isinstance(s, bool)]
    if not found or len(found) != len(given):
        raise ValueError(f"{name} must be 'auto', a size or a list of sizes dividing the {ranks} ranks, got "
                         f"{sizes!r}; choose among {divisors}")
    bad = [s for s in found if s < 1 or ranks % s]
    if bad:
        raise ValueError(f"{name}={bad} does not divide the {ranks} ranks into pp x {name}; choose sizes among "
                         f"{divisors} (or plan with ranks a multiple of {bad[0]})")
    return sorted(set(found))


def split_sizes(dp_replicate: DpShard, dp_shard: DpShard, ranks: int) -> list[tuple[int, int]]:
    """The ``(dp_replicate, dp_shard)`` pairs to plan ``ranks`` ranks with (each side as :func:`shard_sizes`),
    those whose product divides ``ranks``.

    Raises:
        ValueError: bad sizes, or sizes given on both sides whose products never divide ``ranks``.
    """
    pairs = [(r, s) for r in shard_sizes(dp_replicate, ranks, "dp_replicate") for s in shard_sizes(dp_shard, ranks)
             if ranks % (r * s) == 0]
    if not pairs:
        raise ValueError(f"dp_replicate={dp_replicate!r} x dp_shard={dp_shard!r}: no pair of sizes divides the "
                         f"{ranks} ranks into pp x dp_replicate x dp_shard; choose sizes whose product divides {ranks}")
    return pairs


def zero_modes(zero: Sequence[int]) -> list[bool]:
    """``reshard_after_forward`` for each ZeRO stage in ``zero`` (3 and/or 2).

    Raises:
        ValueError: a stage other than 2 or 3.
    """
    bad = [z for z in zero if z not in ZERO_MODES]
    if bad or not zero:
        raise ValueError(f"zero={list(zero)}: choose ZeRO stages among {sorted(ZERO_MODES)} (3: reshard_after_forward="
                         f"True, 2: False)")
    return [ZERO_MODES[z] for z in sorted(set(zero), reverse=True)]


def split_candidates(costs: Costs, ranks: int, runner: str, dp_shard: DpShard, zero: Sequence[int],
                     dp_replicate: DpShard = None, units: Sequence[str] = UNITS,
                     reduces: Sequence[str] = REDUCES, **options: Any) -> tuple[list["Candidate"], list[str]]:
    """The candidates of every ``pp x dp_replicate x dp_shard`` split of ``ranks``
    (:func:`pipe.plan.candidates.candidates` on each pipeline's B / (dp_replicate x dp_shard) samples), in each
    ZeRO mode where sharded, and under ZeRO-3 in each of ``units`` (``"stage"``, ``"block"``: FSDP's
    ``Shard(unit=...)``), a layer at a time with each of ``reduces`` (``"step"``, ``"micro-batch"``); and why
    any split was left out.

    With one stage per rank ZeRO-2 and ZeRO-3 are the same plan (the program never moves to another stage),
    so only the ZeRO-3 candidate is kept there. A layer at a time is planned where the schedule's backward is
    whole (not the zero-bubble schedules, nor an order built from the costs) and no stage holds a tied weight
    twice (FSDP cannot shard it in two layers), as ``DistributedPipe`` runs it.

    Raises:
        ValueError: ``runner`` is not ``"processes"``, bad sizes, modes, units or reduces, a size given
            explicitly whose micro-batches were not profiled, or no split left at all.
    """
    from pipe.plan.candidates import candidates

    bad = [u for u in units if u not in UNITS] + [r for r in reduces if r not in REDUCES]
    if bad or not units or not reduces:
        raise ValueError(f"units={list(units)}, reduces={list(reduces)}: choose units among {list(UNITS)} and "
                         f"reduces among {list(REDUCES)} (FSDP's Shard(unit=..., reduce=...)), at least one of each")

    if runner != "processes":
        what = "FSDP sharding" if dp_shard is not None else "data-parallel replicas"
        given = f"dp_shard={dp_shard!r}" if dp_shard is not None else f"dp_replicate={dp_replicate!r}"
        raise ValueError(f"{given} plans {what}, which only DistributedPipe runs; "
                         f"pass runner='processes' (got runner={runner!r})")
    explicit = dp_shard != "auto" and dp_replicate != "auto"
    modes = zero_modes(zero)
    found: list["Candidate"] = []
    skipped: list[str] = []
    for replicas, size in split_sizes(dp_replicate, dp_shard, ranks):
        pp = ranks // (replicas * size)
        label = (f"dp_replicate={replicas} x dp_shard={size}" if replicas > 1 and size > 1 else
                 f"dp_replicate={replicas}" if replicas > 1 else f"dp_shard={size}")
        try:
            view = replica_costs(costs, replicas * size, label)
            plans = candidates(view, pp, runner, **options)
        except ValueError as error:
            if explicit:
                raise
            axes = f"pp{pp}" + (f" x dp_replicate{replicas}" if replicas > 1 else "")
            skipped.append(axes + (f" x dp_shard{size}" if size > 1 or replicas == 1 else "") + f": {error}")
            continue
        for c in plans:
            c = replace(c, dp_replicate=replicas)
            if size == 1:
                found.append(c)
                continue
            if _tied_across_stages(costs, c):
                continue  # FSDP cannot shard one parameter for two stages of a rank (DistributedPipe refuses)
            for reshard in modes:
                if c.virtual_stages == 1 and not reshard and True in modes:
                    continue  # the same plan as ZeRO-3
                sharded = replace(c, dp_shard=size, reshard_after_forward=reshard)
                if not reshard or "stage" in units:
                    found.append(sharded)
                if reshard and "block" in units and _by_layer(costs, c):
                    found.extend(replace(sharded, unit="block", reduce=r) for r in reduces)
    if not found:
        raise ValueError(f"no pp x dp_replicate x dp_shard split of {ranks} ranks can be planned: " + "; ".join(skipped))
    return found, skipped


def _by_layer(costs: Costs, candidate: "Candidate") -> bool:
    """Whether FSDP can gather ``candidate``'s stages a layer at a time: its backward is whole (no zero-bubble
    schedule, no order built from the costs, which may split it) and no stage holds a tied weight twice."""
    from pipe.plan.candidate import AUTO_KINDS

    if candidate.schedule in AUTO_KINDS or candidate.layout().splits_backward:
        return False
    stage_of = [s for s, n in enumerate(candidate.balance) for _ in range(n)]
    return not any(len({stage_of[k] for k in layers}) < len(layers) for layers, _ in costs.tied)


def _tied_across_stages(costs: Costs, candidate: "Candidate") -> bool:
    """Whether a tied weight is held by two stages of one rank in ``candidate``."""
    if not costs.tied:
        return False
    stage_of = [s for s, n in enumerate(candidate.balance) for _ in range(n)]
    schedule = candidate.layout()
    return any(len({stage_of[k] for k in layers if schedule.rank_of(stage_of[k]) == rank}) > 1
               for layers, _ in costs.tied for rank in range(schedule.ranks))


def split_summary(predictions: Sequence["Prediction"], bounds: dict["Candidate", float],
                  fits: Callable[["Candidate"], bool], best: "Prediction", budget: int) -> list[str]:
    """One line per split (``pp x dp_replicate x dp_shard``, ZeRO mode, what FSDP gathers at a time): its best
    plan, or why it lost."""
    def key(c: "Candidate") -> tuple[int, int, bool, str]:
        return c.dp_replicate, c.dp_shard, c.dp_shard == 1 or c.reshard_after_forward, c.blocks

    splits = sorted({key(c) for c in bounds}, key=lambda k: (k[0] * k[1], k[1], not k[2], ("", *REDUCES).index(k[3])))
    labels = {split: split_text(next(c for c in bounds if key(c) == split)) for split in splits}
    width = max(26, *(len(label) for label in labels.values()))
    lines = []
    for split in splits:
        mine = [p for p in predictions if key(p.candidate) == split]
        label = labels[split]
        fitting = [p for p in mine if fits(p.candidate)]
        if best.candidate in [p.candidate for p in fitting]:
            why = f"chosen ({best.step_time * 1e3:.2f} ms)"
        elif fitting:
            top = min(fitting, key=lambda p: p.step_time)
            why = f"best fitting plan {top.step_time * 1e3:.2f} ms, slower by {top.step_time / best.step_time - 1:+.1%}"
        elif mine:
            top = min(mine, key=lambda p: p.peak)
            why = (f"over budget: the smallest peak of its {len(mine)} simulated plans is {format_bytes(top.peak)} "
                   f"> {format_bytes(budget)}")
        else:
            low = min(b for c, b in bounds.items() if key(c) == split)
            why = (f"slower: its fastest possible step ({low * 1e3:.2f} ms, a lower bound) > the chosen "
                   f"{best.step_time * 1e3:.2f} ms" if low > best.step_time else
                   "over budget: its plans that could be faster were walked and do not fit")
        lines.append(f"{label:<{width}} {why}")
    return lines
