"""Splitting ranks between pipeline and FSDP sharding: ``pp x dp_shard`` candidates, their memory and time.

``DistributedPipe(..., mesh=make_mesh(pp=P, dp_shard=S), shard=Shard(...))``
runs P pipeline ranks, each stage sharded over S ranks with FSDP2, and its
runner (:class:`pipe.distributed.fsdp.StageSharding`) drives the gathers: a
stage is gathered before its first action of the step (the next action's
stage prefetched), kept gathered within a run of its actions, resharded when
the program moves on (ZeRO-3, ``reshard_after_forward=True``) or after its
last action (ZeRO-2), and its gradients are reduce-scattered once, after its
last backward. The planner follows the very same per-action plan
(:func:`pipe.distributed.fsdp.sharding_plan`):

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
  ``(S - 1) x (latency + collective_overhead + group bytes / S x per_byte)``
  over the link (a ring), plus ``shard_step_overhead`` per sharded stage and
  step, added to the action before which (after which, for the
  reduce-scatter) the runner issues it; both overheads are measured with the
  link (:func:`pipe.plan.link.measure_link`, on 2 ranks). The overlap of
  prefetches with compute is not modelled, nor ranks that outnumber the cores.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from pipe.core.schedule import Action, Phase, Schedule
from pipe.plan.cost import Costs

if TYPE_CHECKING:  # pragma: no cover
    from pipe.plan.predict import Candidate, Prediction
    from pipe.plan.timing import Link

__all__: list[str] = []

#: ``reshard_after_forward`` of ``pipe.distributed.Shard`` by ZeRO stage.
ZERO_MODES: dict[int, bool] = {3: True, 2: False}


def divisor_splits(ranks: int) -> list[int]:
    """The ``dp_shard`` sizes that split ``ranks`` into ``pp x dp_shard`` (every divisor)."""
    return [s for s in range(1, ranks + 1) if ranks % s == 0]


def replica_costs(costs: Costs, dp_shard: int) -> Costs:
    """The costs one pipeline of a shard group sees: the same profile, on B / ``dp_shard`` samples.

    Chunks c then mean micro-batches of B/(dp_shard*c) rows, the rows profiled
    for chunks ``dp_shard*c``; counted bytes are shared with ``costs`` (cached once).

    Raises:
        ValueError: the batch does not divide by ``dp_shard``, or no profiled
            micro-batch size fits (the message names the chunk counts to profile).
    """
    if dp_shard == 1:
        return costs
    cache = costs._replicas
    if dp_shard in cache:
        return cache[dp_shard]
    if costs.batch % dp_shard:
        raise ValueError(f"dp_shard={dp_shard} does not divide the mini-batch of {costs.batch} samples: each shard "
                         f"rank takes batch / dp_shard of it; choose a batch that divides by {dp_shard}, or leave "
                         f"dp_shard={dp_shard} out of the splits")
    batch = costs.batch // dp_shard
    kept = sorted(rows for rows in costs.forward if batch % rows == 0)
    if not kept:
        raise ValueError(
            f"dp_shard={dp_shard} runs micro-batches of {batch} / chunks samples, but the profile has none of "
            f"them (profiled chunk counts {costs.chunk_options()}); profile with chunks that include "
            f"{[dp_shard * c for c in range(1, batch + 1) if batch % c == 0][:3]} (chunks c at dp_shard {dp_shard} is the profile of "
            f"chunks {dp_shard}*c)")
    view = Costs(batch, {r: costs.forward[r] for r in kept}, {r: costs.backward[r] for r in kept},
                 costs._memory, costs.param_bytes, param_scale=costs.param_scale,
                 output_bytes={r: b for r, b in costs.output_bytes.items() if r in kept},
                 grad_bytes={r: b for r, b in costs.grad_bytes.items() if r in kept},
                 input_grad={r: costs.input_grad[r] for r in kept}, weight_grad={r: costs.weight_grad[r] for r in kept},
                 replay={r: costs.replay[r] for r in kept},
                 select_replay={r: costs.select_replay[r] for r in kept} if costs.select_replay is not None else None,
                 select=costs.select)
    view._memory_cache = costs._memory_cache  # keyed by rows: the same counts
    cache[dp_shard] = view
    return view


def _stage_bytes(costs: Costs, bounds: list[tuple[int, int]], stage: int) -> int:
    return sum(costs.param_bytes[bounds[stage][0]:bounds[stage][1]])


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
    """

    during: list[int]
    fresh: frozenset[int]


def held_by_fsdp(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]], dp_shard: int,
                 zero3: bool) -> Held:
    """What FSDP holds unsharded during each action of ``rank``'s program (activations apart).

    Follows the runner's plan (:func:`pipe.distributed.fsdp.sharding_plan`): a
    stage's full parameters from the wait for its gather to its reshard; a
    prefetch issued before action k and waited for before action k + 1 holds
    its gathered buffer (the stage's bytes; the input shard is a view of it) during action k;
    a stage's full gradients from its first backward to the reduce-scatter
    after its last (the first ``B`` or ``W`` of a stage counts those it
    creates in its own peak: each weight's new gradient becomes its
    ``.grad``, where a later one is added to it).
    """
    from pipe.distributed.fsdp import sharding_plan

    program = _program(schedule, rank)
    events = sharding_plan(program, zero3, training=True)
    weights = (Phase.WEIGHT,) if schedule.splits_backward else (Phase.BACKWARD,)
    first_grad: dict[int, int] = {}
    for k, action in enumerate(program):
        if action.phase in weights:
            first_grad.setdefault(action.stage, k)
    reduced = {s: k for k, event in enumerate(events) for s in event.reduce}
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


def collective_seconds(costs: Costs, schedule: Schedule, rank: int, bounds: list[tuple[int, int]], dp_shard: int,
                       zero3: bool, link: Optional["Link"]) -> dict[Action, float]:
    """Seconds of the all-gathers issued before, and the reduce-scatters issued after, each action of ``rank``.

    Each FSDP group (a layer with parameters) is gathered and reduce-scattered
    over a ring of ``dp_shard`` ranks: ``dp_shard - 1`` messages of its bytes / ``dp_shard``,
    each with the link's ``collective_overhead``; a stage's reduction adds ``shard_step_overhead``.
    """
    if link is None or dp_shard == 1:
        return {}
    from pipe.distributed.fsdp import sharding_plan

    def ring(stage: int) -> float:
        first, stop = bounds[stage]
        return sum((dp_shard - 1) * (link.cost(-(-b // dp_shard)) + link.collective_overhead)
                   for b in costs.param_bytes[first:stop] if b)

    program = _program(schedule, rank)
    events = sharding_plan(program, zero3, training=True)
    return {action: sum(ring(s) for s in events[k].unshard)
            + sum(ring(s) + link.shard_step_overhead for s in events[k].reduce)
            for k, action in enumerate(program)}


def split_text(candidate: "Candidate") -> str:
    """``pp2 x dp_shard2 zero3``: how the candidate splits its ranks."""
    if candidate.dp_shard == 1:
        return f"pp{candidate.ranks} x dp_shard1"
    return f"pp{candidate.ranks} x dp_shard{candidate.dp_shard} zero{3 if candidate.reshard_after_forward else 2}"


DpShard = Union[None, str, int, Sequence[int]]


def shard_sizes(dp_shard: DpShard, ranks: int) -> list[int]:
    """The ``dp_shard`` sizes to plan ``ranks`` ranks with: ``"auto"`` every divisor, or those given.

    Raises:
        ValueError: a size that does not divide ``ranks`` (named, with the divisors to choose from).
    """
    divisors = divisor_splits(ranks)
    if dp_shard == "auto":
        return divisors
    given: list[object] = [dp_shard] if isinstance(dp_shard, int) else list(dp_shard or [])
    sizes = [s for s in given if isinstance(s, int) and not isinstance(s, bool)]
    if not sizes or len(sizes) != len(given):
        raise ValueError(f"dp_shard must be 'auto', a size or a list of sizes dividing the {ranks} ranks, got "
                         f"{dp_shard!r}; choose among {divisors}")
    bad = [s for s in sizes if s < 1 or ranks % s]
    if bad:
        raise ValueError(f"dp_shard={bad} does not divide the {ranks} ranks into pp x dp_shard; choose sizes among "
                         f"{divisors} (or plan with ranks a multiple of {bad[0]})")
    return sorted(set(sizes))


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
                     **options: Any) -> tuple[list["Candidate"], list[str]]:
    """The candidates of every ``pp x dp_shard`` split of ``ranks`` (:func:`pipe.plan.candidates.candidates`
    on each pipeline's B / dp_shard samples), in each ZeRO mode; and why any split was left out.

    With one stage per rank ZeRO-2 and ZeRO-3 are the same plan (the program never moves to another stage),
    so only the ZeRO-3 candidate is kept there.

    Raises:
        ValueError: ``runner`` is not ``"processes"``, bad sizes or modes, a size given explicitly whose
            micro-batches were not profiled, or no split left at all.
    """
    from pipe.plan.candidates import candidates

    if runner != "processes":
        raise ValueError(f"dp_shard={dp_shard!r} plans FSDP sharding, which only DistributedPipe runs; "
                         f"pass runner='processes' (got runner={runner!r})")
    explicit = dp_shard != "auto"
    modes = zero_modes(zero)
    found: list["Candidate"] = []
    skipped: list[str] = []
    for size in shard_sizes(dp_shard, ranks):
        pp = ranks // size
        try:
            view = replica_costs(costs, size)
            plans = candidates(view, pp, runner, **options)
        except ValueError as error:
            if explicit:
                raise
            skipped.append(f"pp{pp} x dp_shard{size}: {error}")
            continue
        for c in plans:
            if size == 1:
                found.append(c)
                continue
            for reshard in modes:
                if c.virtual_stages == 1 and not reshard and True in modes:
                    continue  # the same plan as ZeRO-3
                found.append(replace(c, dp_shard=size, reshard_after_forward=reshard))
    if not found:
        raise ValueError(f"no pp x dp_shard split of {ranks} ranks can be planned: " + "; ".join(skipped))
    return found, skipped


def split_summary(predictions: Sequence["Prediction"], bounds: dict["Candidate", float],
                  fits: Callable[["Candidate"], bool], best: "Prediction", budget: int) -> list[str]:
    """One line per split (``pp x dp_shard``, ZeRO mode): its best plan, or why it lost."""
    from pipe.plan.search import format_bytes

    keys = sorted({(c.dp_shard, c.reshard_after_forward, c.ranks) for c in bounds}, key=lambda k: (k[0], not k[1]))
    lines = []
    for size, reshard, pp in keys:
        mine = [p for p in predictions if (p.candidate.dp_shard, p.candidate.reshard_after_forward) == (size, reshard)]
        label = split_text(next(c for c in bounds if (c.dp_shard, c.reshard_after_forward) == (size, reshard)))
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
            low = min(b for c, b in bounds.items() if (c.dp_shard, c.reshard_after_forward) == (size, reshard))
            why = (f"slower: its fastest possible step ({low * 1e3:.2f} ms, a lower bound) > the chosen "
                   f"{best.step_time * 1e3:.2f} ms" if low > best.step_time else
                   "over budget: its plans that could be faster were walked and do not fit")
        lines.append(f"{label:<26} {why}")
    return lines

