"""Tests for pipe.core.schedule: hand-computed tables, timelines, bounds and errors."""

from __future__ import annotations

import doctest
import itertools
import math
import subprocess
import sys

import pytest

import pipe.core.schedule
from helpers import without_lowering_cache
from pipe.core.program_time import phase_durations, time_schedule
from pipe.core.action import Action, Phase, TimedAction
from pipe.core.schedule import SCHEDULE_KINDS, Schedule

F, B, R = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE
I, W = Phase.INPUT, Phase.WEIGHT


def names(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def valid_schedules() -> list[Schedule]:
    grid = []
    for kind, ranks, microbatches in itertools.product(SCHEDULE_KINDS, range(1, 5), range(1, 9)):
        if kind == "looped-bfs":
            grid += [Schedule(kind, ranks, microbatches, v) for v in (1, 2, 3)]
        elif kind != "interleaved":
            grid.append(Schedule(kind, ranks, microbatches))
        elif microbatches % ranks == 0:
            grid += [Schedule(kind, ranks, microbatches, v) for v in (1, 2, 3)]
    return grid


GRID = valid_schedules()


def label(schedule: Schedule) -> str:
    s = schedule
    return f"{s.kind}-K{s.ranks}-M{s.microbatches}-v{s.virtual_stages}"


def render(schedule: Schedule) -> list[str]:
    """Draw the unit-time timeline the way the docstring diagrams do."""
    timeline = time_schedule(schedule, phase_durations(forward=1.0, backward=1.0))
    cells = [[". "] * int(max(t.end for t in timeline)) for _ in range(schedule.ranks)]
    for t in timeline:
        cells[t.rank][int(t.start)] = f"{t.action.phase.value}{t.action.microbatch}"
    return [f"rank {r} | " + " ".join(row).rstrip() for r, row in enumerate(cells)]


# Actions -------------------------------------------------------------------


def test_action_str_and_phase_values() -> None:
    assert str(Action(F, 3, 1)) == "F3@1"
    assert str(Action(B, 0, 2)) == "B0@2"
    assert str(Action(R, 5, 0)) == "R5@0"
    assert [p.value for p in Phase] == ["F", "B", "R", "I", "W"]
    assert Phase("F") is F


def test_schedule_and_action_are_hashable_values() -> None:
    assert Schedule("1f1b", 2, 4) == Schedule("1f1b", 2, 4)
    assert len({Schedule("1f1b", 2, 4), Schedule("1f1b", 2, 4), Schedule("gpipe", 2, 4)}) == 2
    assert len({Action(F, 0, 0), Action(F, 0, 0)}) == 1
    assert TimedAction(Action(F, 0, 0), 0, 1.5, 4.0).duration == 2.5


def test_gpipe_2_ranks_3_microbatches_actions() -> None:
    s = Schedule("gpipe", ranks=2, microbatches=3)
    assert names(s.actions(0)) == "F0@0 F1@0 F2@0 B2@0 B1@0 B0@0".split()
    assert names(s.actions(1)) == "F0@1 F1@1 F2@1 B2@1 B1@1 B0@1".split()


def test_gpipe_2_ranks_3_microbatches_clock_cycles() -> None:
    cycles = Schedule("gpipe", ranks=2, microbatches=3).forward_clock_cycles()
    assert [names(c) for c in cycles] == [["F0@0"], ["F0@1", "F1@0"], ["F1@1", "F2@0"], ["F2@1"]]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7])
def test_gpipe_clock_cycles_are_fill_drain(ranks: int, microbatches: int) -> None:
    cycles = Schedule("gpipe", ranks, microbatches).forward_clock_cycles()
    expected = [
        [Action(F, i, k - i) for i in range(microbatches) if 0 <= k - i < ranks]
        for k in range(microbatches + ranks - 1)
    ]
    assert cycles == expected


def test_1f1b_2_ranks_4_microbatches_actions() -> None:
    s = Schedule("1f1b", ranks=2, microbatches=4)
    assert names(s.actions(0)) == "F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0".split()
    assert names(s.actions(1)) == "F0@1 B0@1 F1@1 B1@1 F2@1 B2@1 F3@1 B3@1".split()


def test_1f1b_4_ranks_8_microbatches_rank_0() -> None:
    s = Schedule("1f1b", ranks=4, microbatches=8)
    # 3 warm-up forwards, 5 forward/backward pairs, 3 cool-down backwards.
    expected = "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7".split()
    assert names(s.actions(0)) == [f"{a}@0" for a in expected]
    assert names(s.actions(3))[:4] == "F0@3 B0@3 F1@3 B1@3".split()


def test_1f1b_fewer_microbatches_than_ranks_is_fill_drain_in_order() -> None:
    s = Schedule("1f1b", ranks=4, microbatches=2)
    assert names(s.actions(0)) == "F0@0 F1@0 B0@0 B1@0".split()
    assert names(s.actions(3)) == "F0@3 B0@3 F1@3 B1@3".split()


def test_interleaved_2_ranks_2_virtual_4_microbatches_actions() -> None:
    # Megatron: warm-up (ranks - r - 1) * 2 + (v - 1) * ranks = 4 on rank 0, 2 on
    # rank 1; forwards go in groups of 2 micro-batches through chunk 0, then chunk 1;
    # backwards through chunk 1, then chunk 0. Stage = chunk * ranks + rank.
    s = Schedule("interleaved", ranks=2, microbatches=4, virtual_stages=2)
    assert names(s.actions(0)) == (
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0".split()
    )
    assert names(s.actions(1)) == (
        "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1".split()
    )


def test_looped_bfs_is_torchs_breadth_first_order() -> None:
    # torch's ScheduleLoopedBFS: every forward of the rank's first stage, then its next; backwards
    # last stage first, micro-batches in reverse. Stages placed as interleaved: s on rank s % ranks.
    schedule = Schedule("looped-bfs", 2, 3, 2)
    assert names(schedule.actions(1)) == ["F0@1", "F1@1", "F2@1", "F0@3", "F1@3", "F2@3",
                                          "B2@3", "B1@3", "B0@3", "B2@1", "B1@1", "B0@1"]
    assert schedule.stages_of(1) == [1, 3]
    assert Schedule("looped-bfs", 2, 3).actions(0) == Schedule("gpipe", 2, 3).actions(0)  # one stage per rank
    # Breadth first: the bubble shrinks with the virtual stages, at the price of every micro-batch in flight.
    assert Schedule("looped-bfs", 2, 4, 2).bubble_fraction() < Schedule("gpipe", 2, 4).bubble_fraction()
    assert schedule.peak_inflight() == [6, 6]


def test_placement() -> None:
    s = Schedule("interleaved", ranks=2, microbatches=4, virtual_stages=3)
    assert s.stages == 6
    assert [s.rank_of(stage) for stage in range(6)] == [0, 1, 0, 1, 0, 1]
    assert s.stages_of(0) == [0, 2, 4]
    assert s.stages_of(1) == [1, 3, 5]
    flat = Schedule("1f1b", ranks=3, microbatches=4)
    assert flat.stages == 3
    assert [flat.stages_of(r) for r in range(3)] == [[0], [1], [2]]


# Timelines -----------------------------------------------------------------


def test_gpipe_simulated_timeline() -> None:
    timeline = time_schedule(Schedule("gpipe", ranks=2, microbatches=3), phase_durations(forward=1.0, backward=2.0))
    assert [(str(t.action), t.rank, t.start, t.end) for t in timeline] == [
        ("F0@0", 0, 0.0, 1.0),
        ("F1@0", 0, 1.0, 2.0),
        ("F0@1", 1, 1.0, 2.0),
        ("F2@0", 0, 2.0, 3.0),
        ("F1@1", 1, 2.0, 3.0),
        ("F2@1", 1, 3.0, 4.0),
        ("B2@1", 1, 4.0, 6.0),
        ("B2@0", 0, 6.0, 8.0),
        ("B1@1", 1, 6.0, 8.0),
        ("B1@0", 0, 8.0, 10.0),
        ("B0@1", 1, 8.0, 10.0),
        ("B0@0", 0, 10.0, 12.0),
    ]


@pytest.mark.parametrize("schedule", GRID, ids=label)
def test_simulated_timeline_respects_order_and_dependencies(schedule: Schedule) -> None:
    timeline = time_schedule(schedule, phase_durations(forward=1.0, backward=2.5))
    assert timeline == sorted(timeline, key=lambda t: (t.start, t.rank))
    end = {t.action: t.end for t in timeline}
    start = {t.action: t.start for t in timeline}
    phases = 3 if schedule.splits_backward else 2
    assert len(end) == len(timeline) == phases * schedule.stages * schedule.microbatches
    last = schedule.stages - 1
    for a in end:
        if a.phase is F and a.stage > 0:
            assert start[a] >= end[Action(F, a.microbatch, a.stage - 1)]
        if a.phase in (B, I):
            i, stage = a.microbatch, a.stage
            before = Action(F, i, last) if stage == last else Action(a.phase, i, stage + 1)
            assert start[a] >= end[before]
        if a.phase is W:
            assert start[a] >= end[Action(I, a.microbatch, a.stage)]
    for rank in range(schedule.ranks):
        mine = [t for t in timeline if t.rank == rank]
        assert [t.action for t in mine] == schedule.actions(rank)
        assert all(x.end <= y.start for x, y in zip(mine, mine[1:]))


def test_recompute_precedes_each_backward_without_waiting_for_the_gradient() -> None:
    timeline = time_schedule(Schedule("gpipe", ranks=2, microbatches=1), phase_durations(1.0, 2.0, recompute=1.0),
                             checkpoint_stop=1)
    assert [(str(t.action), t.rank, t.start, t.end) for t in timeline] == [
        ("F0@0", 0, 0.0, 1.0),
        ("R0@0", 0, 1.0, 2.0),  # overlaps the wait for the gradient from rank 1
        ("F0@1", 1, 1.0, 2.0),
        ("R0@1", 1, 2.0, 3.0),
        ("B0@1", 1, 3.0, 5.0),
        ("B0@0", 0, 5.0, 7.0),
    ]


@pytest.mark.parametrize("schedule", GRID[::5], ids=label)
def test_recompute_sits_right_before_its_backward_on_the_same_rank(schedule: Schedule) -> None:
    timeline = time_schedule(schedule, phase_durations(1.0, 2.0, recompute=0.5), checkpoint_stop=schedule.microbatches)
    recomputes = [t for t in timeline if t.action.phase is R]
    assert len(recomputes) == schedule.stages * schedule.microbatches
    for rank in range(schedule.ranks):
        mine = [t for t in timeline if t.rank == rank]
        for redo, after in zip(mine, mine[1:]):
            if redo.action.phase is R:
                backward = I if schedule.splits_backward else B  # split: recomputed once, before I
                assert after.action == Action(backward, redo.action.microbatch, redo.action.stage)
                assert redo.end <= after.start and redo.duration == 0.5
    gpipe = Schedule("gpipe", 2, 4)  # a recompute of no time is left out
    assert time_schedule(gpipe, phase_durations(recompute=0.0), checkpoint_stop=4) == time_schedule(gpipe)


def test_checkpoint_stop_recomputes_only_the_leading_microbatches() -> None:
    # Pipe's checkpoint="except_last" with 3 micro-batches: 0 and 1 recompute, 2 does not.
    schedule = Schedule("gpipe", ranks=2, microbatches=3)
    timeline = time_schedule(schedule, phase_durations(1.0, 2.0, recompute=1.0), checkpoint_stop=2)
    assert sorted(str(t.action) for t in timeline if t.action.phase is R) == ["R0@0", "R0@1", "R1@0", "R1@1"]
    assert time_schedule(schedule, phase_durations(recompute=1.0), checkpoint_stop=0) == time_schedule(schedule)


def test_docstring_diagrams_match_the_simulation() -> None:
    lines = (Schedule.__doc__ or "").splitlines()
    drawn = [line.strip() for line in lines if line.strip().startswith("rank ") and "|" in line]
    assert drawn == render(Schedule("gpipe", 3, 4)) + render(Schedule("1f1b", 3, 4))


def test_docstring_examples() -> None:
    assert doctest.testmod(pipe.core.schedule).failed == 0


@pytest.mark.parametrize("schedule", GRID, ids=label)
def test_forward_clock_cycles_cover_forwards_in_dependency_order(schedule: Schedule) -> None:
    cycles = schedule.forward_clock_cycles()
    tick = {a: k for k, cycle in enumerate(cycles) for a in cycle}
    assert len(tick) == sum(map(len, cycles)) == schedule.stages * schedule.microbatches
    assert all(cycles) and all(a.phase is F for a in tick)
    for a in tick:
        if a.stage > 0:
            assert tick[a] > tick[Action(F, a.microbatch, a.stage - 1)]
        assert len({schedule.rank_of(b.stage) for b in cycles[tick[a]]}) == len(cycles[tick[a]])


# Bubble and memory ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_bubble_fraction_matches_formula(
    kind: str, ranks: int, microbatches: int, backward: float
) -> None:
    bubble = Schedule(kind, ranks, microbatches).bubble_fraction(forward=1.0, backward=backward)
    assert bubble == pytest.approx((ranks - 1) / (microbatches + ranks - 1))


def test_bubble_fraction_defaults_and_interleaving() -> None:
    assert Schedule("gpipe", 4, 4).bubble_fraction() == pytest.approx(3 / 7)
    plain = Schedule("1f1b", 4, 8).bubble_fraction()
    interleaved = Schedule("interleaved", 4, 8, virtual_stages=2).bubble_fraction()
    assert interleaved < plain
    assert Schedule("gpipe", 1, 3).bubble_fraction() == 0.0
    # Recompute is busy time and lengthens the step; transfers are free.
    assert 0.0 < Schedule("gpipe", 2, 4).bubble_fraction(recompute=1.0) < 1.0


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
def test_peak_inflight(ranks: int, microbatches: int) -> None:
    assert Schedule("1f1b", ranks, microbatches).peak_inflight() == [
        min(ranks - r, microbatches) for r in range(ranks)
    ]
    assert Schedule("gpipe", ranks, microbatches).peak_inflight() == [microbatches] * ranks


def test_peak_inflight_interleaved_counts_chunks() -> None:
    assert Schedule("interleaved", 2, 4, virtual_stages=2).peak_inflight() == [5, 3]


# Validation ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", GRID, ids=label)
def test_validate_passes_for_every_valid_schedule(schedule: Schedule) -> None:
    schedule.validate()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(kind="foo", ranks=2, microbatches=4),
            r"unknown schedule kind 'foo'; expected one of 'gpipe', '1f1b', 'interleaved'",
        ),
        (dict(kind="gpipe", ranks=0, microbatches=2), r"^ranks must be a positive int.* \(got 0\)"),
        (dict(kind="gpipe", ranks=2.0, microbatches=4), r"ranks must be .* \(got 2\.0\)"),
        (dict(kind="gpipe", ranks=True, microbatches=4), r"ranks must be .* \(got True\)"),
        (
            dict(kind="1f1b", ranks=2, microbatches=-1),
            r"microbatches must be a positive integer \(got -1\); pass an int >= 1",
        ),
        (
            dict(kind="interleaved", ranks=2, microbatches=4, virtual_stages=0),
            r"virtual_stages must be a positive integer \(got 0\)",
        ),
        (
            dict(kind="gpipe", ranks=2, microbatches=4, virtual_stages=2),
            r"virtual_stages=2 needs kind='interleaved' or 'looped-bfs'; "
            r"'gpipe' runs one stage per rank \(use virtual_stages=1\)",
        ),
        (
            dict(kind="1f1b", ranks=2, microbatches=4, virtual_stages=3),
            r"virtual_stages=3 needs kind='interleaved' or 'looped-bfs'; '1f1b' runs one stage per rank",
        ),
        (
            dict(kind="interleaved", ranks=4, microbatches=6, virtual_stages=2),
            r"interleaved schedule needs microbatches divisible by ranks "
            r"\(got microbatches=6, ranks=4\); use a multiple of 4, such as 4 or 8",
        ),
        (
            dict(kind="interleaved", ranks=4, microbatches=2, virtual_stages=2),
            r"\(got microbatches=2, ranks=4\); use a multiple of 4, such as 4 or 8",
        ),
        (dict(kind="interleaved", ranks=2, microbatches=5), r"such as 4 or 6"),
    ],
)
def test_constructor_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)  # type: ignore[arg-type]


def test_rank_and_stage_out_of_range() -> None:
    s = Schedule("interleaved", ranks=2, microbatches=2, virtual_stages=2)
    message = r"rank 2 is out of range for a schedule with 2 ranks; expected 0 <= rank < 2"
    with pytest.raises(ValueError, match=message):
        s.actions(2)
    with pytest.raises(ValueError, match=r"rank -1 is out of range"):
        s.stages_of(-1)
    message = r"stage 4 is out of range for a schedule with 4 stages; expected 0 <= stage < 4"
    with pytest.raises(ValueError, match=message):
        s.rank_of(4)


@pytest.mark.parametrize(
    ("durations", "message"),
    [
        (
            dict(forward=0.0),
            r"forward duration must be a finite number > 0 \(got 0\.0\); durations are relative",
        ),
        (dict(backward=-1.0), r"backward duration must be a finite number > 0 \(got -1\.0\)"),
        (dict(forward=math.inf), r"forward duration must be a finite number > 0 \(got inf\)"),
        (dict(recompute=-0.5), r"recompute duration must be a finite number >= 0 \(got -0\.5\)"),
        (dict(recompute=math.nan), r"recompute duration must be .* >= 0 \(got nan\)"),
    ],
)
def test_duration_errors(durations: dict[str, float], message: str) -> None:
    s = Schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match=message):
        phase_durations(**durations)
    with pytest.raises(ValueError, match=message):
        s.bubble_fraction(**durations)


def parse(text: str) -> list[Action]:
    """``"F0@1 B0@1"`` -> the actions it names."""
    actions = []
    for token in text.split():
        microbatch, stage = token[1:].split("@")
        actions.append(Action(Phase(token[0]), int(microbatch), int(stage)))
    return actions


def patch_tables(monkeypatch: pytest.MonkeyPatch, tables: str) -> None:
    """Make every Schedule run the programs in ``tables``, one rank per ``|``-separated part."""
    programs = [parse(part) for part in tables.split("|")]
    monkeypatch.setattr(Schedule, "actions", lambda self, rank: list(programs[rank]))
    without_lowering_cache(monkeypatch)


@pytest.mark.parametrize(
    ("kind", "tables", "message"),
    [
        ("gpipe", "F0@0 F1@0 B1@0 B0@0 | F0@1 F1@1 B1@1", r"B0@1 is missing"),
        ("gpipe", "F0@0 F1@0 B1@0 B0@0 F0@0 | F0@1 F1@1 B1@1 B0@1", r"F0@0 appears more than once"),
        (
            "gpipe",
            "F0@0 F1@0 B1@0 B0@0 F0@1 | F1@1 B1@1 B0@1",
            r"F0@1 is on rank 0 but stage 1 belongs to rank 1",
        ),
        (
            "gpipe",
            "F0@0 F1@0 B1@0 B0@0 F0@5 | ",
            r"F0@5 is on rank 0 but stage 5 belongs to no rank \(the schedule has 2 stages\)",
        ),
        ("gpipe", "F0@0 B1@0 F1@0 B0@0 | F0@1 F1@1 B1@1 B0@1", r"rank 0 runs B1@0 before F1@0"),
        (
            "gpipe",
            "F0@0 F1@0 R1@0 B1@0 B0@0 | F0@1 F1@1 B1@1 B0@1",
            r"rank 0 has R1@0; programs hold only forwards and backwards",
        ),
        (
            "gpipe",
            "F0@0 F1@0 B1@0 B0@0 F7@0 B7@0 | F0@1 F1@1 B1@1 B0@1",
            r"actions for unknown micro-batches: B7@0, F7@0",
        ),
        (
            "1f1b",
            "F0@0 F1@0 B0@0 B1@0 | F0@1 F1@1 B0@1 B1@1",
            r"rank 1 holds 2 micro-batches in flight; 1F1B allows at most ranks - rank = 1",
        ),
        (
            "1f1b",
            "F0@0 B0@0 F1@0 B1@0 | F1@1 B1@1 F0@1 B0@1",
            r"deadlocks: rank 0 at B0@0 \(waits for B0@1\)",
        ),
    ],
)
def test_validate_reports_bad_tables(
    monkeypatch: pytest.MonkeyPatch, kind: str, tables: str, message: str
) -> None:
    s = Schedule(kind, ranks=2, microbatches=2)
    patch_tables(monkeypatch, tables)
    with pytest.raises(ValueError, match=message):
        s.validate()


def test_simulate_raises_on_deadlock_naming_stuck_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Schedule("1f1b", ranks=2, microbatches=2)
    patch_tables(monkeypatch, "F0@0 B0@0 F1@0 B1@0 | F1@1 B1@1 F0@1 B0@1")
    message = r"rank 0 at WAIT_RECV grad main B0@0<-1; rank 1 at WAIT_RECV act main F1@1<-0"
    with pytest.raises(RuntimeError, match=message):
        time_schedule(s)


# Purity --------------------------------------------------------------------


def test_module_does_not_import_torch() -> None:
    """Schedules are built, validated and timed (their lowered programs simulated) without torch."""
    code = (
        "import sys\n"
        "from pipe.core.schedule import Schedule\n"
        "Schedule('interleaved', 2, 4, 2).validate()\n"
        "assert Schedule('zbv', 2, 4).bubble_fraction() > 0\n"
        "assert 'torch' not in sys.modules, 'pipe/core/schedule.py imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
