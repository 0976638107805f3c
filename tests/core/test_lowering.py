"""The lowered programs: every step a rank takes, as data, validated and timed without torch."""
from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from pipe.core.lowering import COMPUTE, Kind, Routes, Step, gather_events, lower
from pipe.core.program_time import check, simulate
from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.schedule_table import TableSchedule

KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 1)]
COSTS = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.INPUT: 1.0, Kind.WEIGHT: 1.0}


def _programs(schedule: Schedule, routes: Routes, **options: object) -> list[list[Step]]:
    return [lower(schedule.actions(rank), routes, **options) for rank in range(schedule.ranks)]  # type: ignore[arg-type]


def _skips(stages: int) -> Routes:
    return Routes.chain(stages, [(0, stages - 1, "skip0:x")] + ([(1, stages - 2, "skip1:y")] if stages > 3 else []))


@pytest.mark.parametrize("kind,virtual", KINDS)
@pytest.mark.parametrize("ranks,microbatches", [(2, 2), (3, 6), (4, 8)])
def test_every_lowering_of_every_schedule_validates(kind: str, virtual: int, ranks: int, microbatches: int) -> None:
    schedule = Schedule(kind, ranks, microbatches, virtual)
    for routes, zero3, training, replicated, offload in itertools.product(
            [Routes.chain(schedule.stages), _skips(schedule.stages)], [None, False, True], [True, False],
            [False, True], [(), (0,)]):
        programs = _programs(schedule, routes, training=training, checkpoint_stop=microbatches - 1, zero3=zero3,
                             replicated=replicated, offload_stages=offload, offload_horizon=2 if offload else 0)
        check(programs)
        compute = [s.action for p in programs for s in p if s.kind in COMPUTE]
        expected = [a for r in range(ranks) for a in schedule.actions(r) if training or a.phase is Phase.FORWARD]
        assert sorted(map(str, compute)) == sorted(map(str, expected))  # the compute program, untouched


@pytest.mark.parametrize("kind,virtual", KINDS)
def test_timed_schedules_follow_the_dependency_rule(kind: str, virtual: int) -> None:
    """Timed through its lowered programs, every action of a fixed schedule starts once its rank is free (after
    its recompute, which starts as soon as the rank is) and the action it depends on has ended, plus the
    transfer where that action ran on another stage (a message, even to the same rank: the cost functions
    charge 0 there); receives posted one action ahead never delay a message."""
    import random

    from pipe.core.program_time import time_schedule

    rng = random.Random(kind)
    schedule = Schedule(kind, 3, 6, virtual)
    lengths: dict[Action, float] = {}

    def duration(action: Action) -> float:
        return lengths.setdefault(action, rng.uniform(0.5, 2.0))

    def transfer(action: Action) -> float:
        return 0.1 * (1 + action.stage)

    last = schedule.stages - 1
    for stop in (0, 3, 6):
        timed = time_schedule(schedule, duration, transfer, stop)
        ends = {t.action: t.end for t in timed}
        for rank in range(3):
            free = 0.0
            for t in [t for t in timed if t.rank == rank]:
                a = t.action
                if a.phase is Phase.RECOMPUTE:
                    assert t.start == pytest.approx(free) and t.duration == pytest.approx(duration(a))
                    free = t.end
                    continue
                i, s = a.microbatch, a.stage
                needed = (Action(Phase.FORWARD, i, s - 1) if s > 0 else None) if a.phase is Phase.FORWARD \
                    else Action(Phase.INPUT, i, s) if a.phase is Phase.WEIGHT \
                    else Action(Phase.FORWARD, i, s) if s == last else Action(a.phase, i, s + 1)
                ready = free
                if needed is not None:
                    ready = max(ready, ends[needed] + (transfer(a) if needed.stage != s else 0.0))
                assert t.start == pytest.approx(ready), (kind, stop, str(a))
                assert t.duration == pytest.approx(duration(a))
                free = t.end
        assert sum(t.action.phase is Phase.RECOMPUTE for t in timed) == stop * schedule.stages


def test_a_gather_not_prefetched_delays_the_first_forward_and_a_prefetched_one_does_not() -> None:
    schedule = Schedule("interleaved", 2, 4, 2)
    programs = _programs(schedule, Routes.chain(schedule.stages), zero3=True)
    gather = 0.5
    timeline = simulate(programs, lambda step: gather if step.kind is Kind.UNSHARD else COSTS.get(step.kind, 0.0))
    first = next(t for t in timeline if t.rank == 0 and t.lane == "compute")
    assert first.start == pytest.approx(gather)  # nothing to hide the first gather behind
    waits = [t for t in timeline if t.step.kind is Kind.WAIT_UNSHARD]
    assert sum(t.end - t.start for t in waits) < gather * len([t for t in timeline if t.step.kind is Kind.UNSHARD])
    assert {t.lane for t in timeline} >= {"compute", "comm", "send", "wait"}


def test_zero3_gathers_more_often_than_zero2_and_both_reduce_once_per_stage() -> None:
    schedule = Schedule("interleaved", 2, 4, 2)
    program = schedule.actions(0)
    zero3 = lower(program, Routes.chain(4), zero3=True)
    zero2 = lower(program, Routes.chain(4), zero3=False)
    count = lambda steps, kind: sum(1 for s in steps if s.kind is kind)  # noqa: E731
    assert count(zero3, Kind.UNSHARD) > count(zero2, Kind.UNSHARD) == 2
    assert count(zero3, Kind.REDUCE_GRAD) == count(zero2, Kind.REDUCE_GRAD) == 2
    last_backward = {a.stage: str(a) for a in program if a.phase is Phase.BACKWARD}
    assert {s.stage: str(s.action) for s in zero2 if s.kind is Kind.REDUCE_GRAD} == last_backward
    assert [e.unshard for e in gather_events(program, False, True)][:3] == [[0], [2], []]  # stage 2 prefetched
    assert not any(s.kind is Kind.REDUCE_GRAD for s in lower(program, Routes.chain(4), zero3=True, training=False))


def test_a_pass_that_accumulates_reduces_nothing_and_gathers_as_any_other() -> None:
    """``reduce=False`` (``step(..., accumulate=True)``): no reduce-scatter, no replicas' average; the rest alike."""
    program = Schedule("interleaved", 2, 4, 2).actions(0)
    reductions = {Kind.REDUCE_GRAD, Kind.REDUCE_REPLICAS, Kind.FINISH_REPLICAS}
    for options in ({"zero3": True}, {"zero3": False}, {"replicated": True}):
        reducing = lower(program, Routes.chain(4), **options)  # type: ignore[arg-type]
        accumulating = lower(program, Routes.chain(4), reduce=False, **options)  # type: ignore[arg-type]
        assert any(s.kind in reductions for s in reducing), options
        assert [s for s in reducing if s.kind not in reductions] == accumulating, options


def test_recompute_offload_and_replica_steps_land_where_their_features_need_them() -> None:
    schedule = Schedule("1f1b", 2, 4)
    program = schedule.actions(0)
    steps = lower(program, Routes.chain(2), checkpoint_stop=3, replicated=True, offload_stages=[0], offload_horizon=2)
    recomputed = [str(s.action) for s in steps if s.kind is Kind.RECOMPUTE]
    assert recomputed == ["B0@0", "B1@0", "B2@0"]  # micro-batches < checkpoint_stop only, before each backward
    for k, step in enumerate(steps):
        if step.kind is Kind.RECOMPUTE:  # ahead of the wait for its gradient
            wait = next(j for j, s in enumerate(steps) if s.kind is Kind.WAIT_RECV and s.action == step.action)
            assert k < wait
    compute = [s for s in steps if s.kind in COMPUTE]
    for step in (s for s in steps if s.kind is Kind.PREFETCH):
        assert step.action.phase is Phase.BACKWARD and 1 <= step.ahead <= 2
        tagged = [s for s in steps[:steps.index(step)] if s.kind is Kind.OFFLOAD][-1]
        assert compute.index(Step(Kind.BACKWARD, step.action, 0)) - compute.index(
            Step(Kind(tagged.action.phase.value), tagged.action, 0)) == step.ahead
    assert [str(s) for s in steps if s.kind is Kind.REDUCE_REPLICAS] == ["REDUCE_REPLICAS 0"]
    assert steps.index(next(s for s in steps if s.kind is Kind.REDUCE_REPLICAS)) > \
        steps.index(Step(Kind.BACKWARD, Action(Phase.BACKWARD, 3, 0), 0))
    assert [s.kind for s in steps[-2:]] == [Kind.FLUSH, Kind.FINISH_REPLICAS]


def test_check_names_what_breaks_a_lowered_program() -> None:
    schedule = Schedule("1f1b", 2, 2)
    good = _programs(schedule, Routes.chain(2))
    lost = [[s for s in good[0] if not (s.kind is Kind.SEND and s.microbatch == 1)], good[1]]
    with pytest.raises(ValueError, match="never sends"):
        check(lost)
    twice = [good[0] + [s for s in good[0] if s.kind is Kind.SEND][:1], good[1]]
    with pytest.raises(ValueError, match="already sent"):
        check(twice)
    unposted = [good[0], [s for s in good[1] if not (s.kind in (Kind.POST_RECV, Kind.WAIT_RECV) and s.microbatch == 0)]]
    with pytest.raises(ValueError, match="never posts its receive"):
        check(unposted)
    waits_first = list(good[1])
    post = next(k for k, s in enumerate(waits_first) if s.kind is Kind.POST_RECV)
    waits_first[post], waits_first[post + 1] = waits_first[post + 1], waits_first[post]
    with pytest.raises(ValueError, match="waits for a receive it has not posted"):
        check([good[0], waits_first])
    sharded = _programs(schedule, Routes.chain(2), zero3=True)
    ungathered = [[s for s in sharded[0] if s.kind is not Kind.WAIT_UNSHARD], sharded[1]]
    with pytest.raises(ValueError, match="not gathered"):
        check(ungathered)


def test_check_finds_ranks_that_wait_for_each_other() -> None:
    """Rank 0 sends its forward only after the backward that waits on rank 1, which waits on that forward."""
    table = TableSchedule.from_table([["F0@0", "B0@0"], ["F0@1", "B0@1"]])
    programs = _programs(table, Routes.chain(2))
    late = [s for s in programs[0] if s.kind is not Kind.SEND] + [s for s in programs[0] if s.kind is Kind.SEND]
    with pytest.raises(ValueError, match="deadlock.*rank 0 at WAIT_RECV grad main B0@0<-1.*rank 1 at WAIT_RECV act"):
        check([late, programs[1]])


def test_the_lowering_loads_no_torch() -> None:
    code = ("import sys, pipe.core.lowering, pipe.core.program_time\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind,virtual", KINDS)
def test_receives_posted_any_number_of_actions_ahead_validate_and_keep_the_compute_program(kind: str,
                                                                                           virtual: int) -> None:
    schedule = Schedule(kind, 3, 6, virtual)
    for ahead, routes in itertools.product((0, 1, 2, 5, 99), [Routes.chain(schedule.stages), _skips(schedule.stages)]):
        programs = _programs(schedule, routes, checkpoint_stop=3, zero3=False, post_ahead=ahead)
        check(programs)
        for rank, program in enumerate(programs):
            assert [s.action for s in program if s.kind in COMPUTE] == schedule.actions(rank)
            actions = [s.action for s in program if s.kind in COMPUTE]
            for k, step in enumerate(program):  # each receive posted `ahead` actions before its action
                if step.kind is Kind.POST_RECV:
                    done = sum(1 for s in program[:k] if s.kind in COMPUTE)
                    assert done == max(0, actions.index(step.action) - ahead), (ahead, rank, step)


def test_a_message_moves_once_its_receive_is_posted() -> None:
    """Rank 1's F0 takes 3 s (2-5 s); rank 0 sends F1 at 2 s, 1 s of bytes. Posted one action ahead (at 2 s)
    they are there at 3 s and F1 starts when F0 ends; posted just before its wait (0 ahead) they move from 5 s."""
    schedule = Schedule("gpipe", 2, 2)
    costs = {Kind.FORWARD: 1.0}

    def f1_start(ahead: int) -> float:
        programs = [lower(schedule.actions(r), Routes.chain(2), training=False, post_ahead=ahead) for r in range(2)]
        timeline = simulate(programs, lambda step: 1.0 if step.kind is Kind.SEND else
                            3.0 if step.kind is Kind.FORWARD and step.stage == 1 else costs.get(step.kind, 0.0))
        return next(t.start for t in timeline if t.step.kind is Kind.FORWARD and str(t.step.action) == "F1@1")

    assert f1_start(1) == pytest.approx(5.0)
    assert f1_start(0) == pytest.approx(6.0)


@pytest.mark.parametrize("ahead", [-1, 1.5, True, "2"])
def test_a_bad_post_ahead_is_refused_with_the_fix(ahead: object) -> None:
    with pytest.raises(ValueError, match=r"post_ahead must be an int >= 0"):
        lower(Schedule("1f1b", 2, 2).actions(0), Routes.chain(2), post_ahead=ahead)  # type: ignore[arg-type]
