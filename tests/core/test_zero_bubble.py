"""Tests for the zero-bubble schedules (pipe.core.zero_bubble through pipe.core.schedule):
tables, the paper's bubble formulas, memory bounds, placement and errors."""

from __future__ import annotations

import doctest

import pytest

import pipe.core.zero_bubble
from helpers import without_lowering_cache
from pipe.core.program_time import phase_durations, time_schedule
from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.zero_bubble import zero_bubble_programs

F, I, W, R = Phase.FORWARD, Phase.INPUT, Phase.WEIGHT, Phase.RECOMPUTE


def idle(schedule: Schedule, forward: float, input_grad: float, weight_grad: float) -> list[float]:
    """Per rank, the simulated makespan minus the rank's busy time."""
    timeline = time_schedule(schedule, phase_durations(forward, input_grad + weight_grad, input_grad=input_grad,
                                                       weight_grad=weight_grad))
    makespan = max(t.end for t in timeline)
    return [makespan - sum(t.duration for t in timeline if t.rank == r) for r in range(schedule.ranks)]


def render(schedule: Schedule) -> list[str]:
    timeline = time_schedule(schedule, phase_durations(forward=1.0, backward=2.0))
    cells = [[". "] * int(max(t.end for t in timeline)) for _ in range(schedule.ranks)]
    for t in timeline:
        cells[t.rank][int(t.start)] = f"{t.action.phase.value}{t.action.microbatch}"
    return [f"rank {r} | " + " ".join(row).rstrip() for r, row in enumerate(cells)]


def test_zb_h1_table_2_ranks() -> None:
    s = Schedule("zb-h1", ranks=2, microbatches=3)
    assert [str(a) for a in s.actions(0)] == ["F0@0", "F1@0", "I0@0", "W0@0", "F2@0", "I1@0", "W1@0", "I2@0", "W2@0"]
    # The last rank defers its W's by one pair: it holds 2 micro-batches, rank 0's (1F1B's) peak.
    assert [str(a) for a in s.actions(1)] == ["F0@1", "I0@1", "F1@1", "I1@1", "W0@1", "F2@1", "I2@1", "W1@1", "W2@1"]
    assert s.peak_inflight() == [2, 2]
    assert Schedule("1f1b", 2, 3).peak_inflight() == [2, 1]


def test_module_docstring_diagram_matches_the_simulation() -> None:
    lines = (pipe.core.zero_bubble.__doc__ or "").splitlines()
    drawn = [line.strip() for line in lines if line.strip().startswith("rank ") and "|" in line]
    assert drawn == render(Schedule("zb-h1", 4, 6))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 4])
@pytest.mark.parametrize(("forward", "input_grad", "weight_grad"),
                         [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 1.0), (2.0, 1.0, 1.0)])
def test_zb_h1_bubble_is_the_papers_formula(
    ranks: int, extra: int, forward: float, input_grad: float, weight_grad: float
) -> None:
    # Qi et al. (ICLR 2024), section 3.1: with T_W <= T_F, T_B, ZB-H1 leaves
    # (p - 1)(T_F + T_B - T_W) idle per rank (M >= p), 1F1B (p - 1)(T_F + T_B + T_W).
    microbatches = ranks + extra
    zb = idle(Schedule("zb-h1", ranks, microbatches), forward, input_grad, weight_grad)
    one_f_one_b = idle(Schedule("1f1b", ranks, microbatches), forward, input_grad, weight_grad)
    assert zb == pytest.approx([(ranks - 1) * (forward + input_grad - weight_grad)] * ranks)
    assert one_f_one_b == pytest.approx([(ranks - 1) * (forward + input_grad + weight_grad)] * ranks)


def test_zb_h1_bubble_is_a_third_of_1f1b_when_phases_are_equal() -> None:
    for ranks, microbatches in [(2, 4), (4, 8), (8, 16)]:
        zb, plain = (idle(Schedule(k, ranks, microbatches), 1.0, 1.0, 1.0)[0] for k in ("zb-h1", "1f1b"))
        assert zb == pytest.approx(plain / 3)
        bubble = Schedule("zb-h1", ranks, microbatches).bubble_fraction(1.0, 2.0)
        assert bubble == pytest.approx((ranks - 1) / (3 * microbatches + ranks - 1))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 16])
def test_zb_h1_memory_is_1f1b_peak(ranks: int, microbatches: int) -> None:
    s = Schedule("zb-h1", ranks, microbatches)
    s.validate()
    assert s.peak_inflight() == [min(ranks, microbatches)] * ranks
    assert max(s.peak_inflight()) == max(Schedule("1f1b", ranks, microbatches).peak_inflight())


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5, 8, 12])
def test_zbv_validates_and_keeps_1f1b_memory(ranks: int, microbatches: int) -> None:
    s = Schedule("zbv", ranks, microbatches)
    s.validate()
    # Cells are half a 1F1B stage: 2p of them weigh what 1F1B's p stages do on rank 0.
    assert max(s.peak_inflight()) <= 2 * ranks
    assert max(s.peak_inflight()) <= 2 * min(ranks, microbatches) or microbatches < ranks


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zbv_bubble_is_below_zb_h1_and_1f1b(ranks: int, microbatches: int) -> None:
    # Same model: a ZB-V stage is half a 1F1B stage, so its phases take half as long.
    v = idle(Schedule("zbv", ranks, microbatches), 0.5, 0.5, 0.5)
    h1 = idle(Schedule("zb-h1", ranks, microbatches), 1.0, 1.0, 1.0)
    plain = idle(Schedule("1f1b", ranks, microbatches), 1.0, 1.0, 1.0)
    # The rule-of-thumb V leaves at most (p - 1) phase-lengths idle (half of ZB-H1's time) when M >= p.
    assert max(v) == pytest.approx(0.5 * (ranks - 1))
    assert max(v) <= max(h1) / 2 + 1e-9 and max(h1) <= max(plain) / 3 + 1e-9
    assert Schedule("zbv", ranks, microbatches).bubble_fraction(0.5, 1.0) < \
        Schedule("interleaved", ranks, microbatches, 2).bubble_fraction(0.5, 1.0)


def test_zbv_v_placement() -> None:
    s = Schedule("zbv", ranks=3, microbatches=3)
    assert s.virtual_stages == 2 and s.stages == 6
    assert [s.rank_of(stage) for stage in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [s.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert Schedule("zbv", 3, 3, virtual_stages=2) == s
    # The loss turns around on rank 0: the last stage's I follows its own forward.
    assert s._dependency(Action(I, 0, 5)) == Action(F, 0, 5)
    assert s._dependency(Action(W, 0, 3)) == Action(I, 0, 3)


def test_recompute_runs_once_before_i_and_w_reuses_it() -> None:
    s = Schedule("zb-h1", ranks=2, microbatches=2)
    timeline = time_schedule(s, phase_durations(1.0, 2.0, recompute=1.0), checkpoint_stop=s.microbatches)
    redo = [t for t in timeline if t.action.phase is R]
    assert len(redo) == s.stages * s.microbatches  # once per cell: not again for W
    for rank in range(s.ranks):
        mine = [t.action for t in timeline if t.rank == rank]
        for a, b in zip(mine, mine[1:]):
            if a.phase is R:
                assert b == Action(I, a.microbatch, a.stage)
    stop = time_schedule(s, phase_durations(1.0, 2.0, recompute=1.0), checkpoint_stop=1)
    assert sorted(str(t.action) for t in stop if t.action.phase is R) == ["R0@0", "R0@1"]


def test_default_split_halves_the_backward() -> None:
    s = Schedule("zb-h1", 2, 2)
    assert time_schedule(s, phase_durations(1.0, 3.0)) == \
        time_schedule(s, phase_durations(1.0, 3.0, input_grad=1.5, weight_grad=1.5))
    durations = {t.action.phase: t.duration
                 for t in time_schedule(s, phase_durations(1.0, 2.0, input_grad=0.5, weight_grad=1.5))}
    assert durations == {F: 1.0, I: 0.5, W: 1.5}


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(kind="zbv", ranks=2, microbatches=2, virtual_stages=3), r"virtual_stages=3 does not fit kind='zbv'"),
    (dict(kind="zb-h1", ranks=2, microbatches=2, virtual_stages=2), r"virtual_stages=2 needs kind='interleaved'"),
])
def test_constructor_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "value"), [("input_grad", 0.0), ("weight_grad", float("nan"))])
def test_split_duration_errors(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{name} duration must be a finite number > 0"):
        phase_durations(**{name: value})  # type: ignore[arg-type]


def test_validate_rejects_a_b_in_a_split_program(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Schedule("zb-h1", 1, 1)
    without_lowering_cache(monkeypatch)
    monkeypatch.setattr(Schedule, "actions", lambda self, rank: [Action(F, 0, 0), Action(Phase.BACKWARD, 0, 0)])
    with pytest.raises(ValueError, match="programs hold only forwards, input and weight gradients"):
        s.validate()
    monkeypatch.setattr(Schedule, "actions", lambda self, rank: [Action(F, 0, 0), Action(W, 0, 0), Action(I, 0, 0)])
    with pytest.raises(ValueError, match=r"runs W0@0 before I0@0"):
        s.validate()


def test_unknown_kind_and_docstrings() -> None:
    with pytest.raises(ValueError, match="'1f1b' is not a zero-bubble schedule"):
        zero_bubble_programs("1f1b", 2, 2)
    assert doctest.testmod(pipe.core.zero_bubble).failed == 0


@pytest.mark.parametrize("ranks", [5, 6, 7, 8])
def test_zbv_bubble_on_more_ranks_stays_below_zb_h1(ranks: int) -> None:
    for microbatches in (ranks, 2 * ranks):
        v = idle(Schedule("zbv", ranks, microbatches), 0.5, 0.5, 0.5)
        h1 = idle(Schedule("zb-h1", ranks, microbatches), 1.0, 1.0, 1.0)
        assert max(v) <= 0.5 * (ranks + 1) < max(h1)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (2, 8), (3, 6), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_zbv_runs_the_papers_v_once_the_v_fills(ranks: int, microbatches: int) -> None:
    # The handcrafted V of the paper, which torch's ScheduleZBVZeroBubble runs too: its order, computed by torch.
    from pipe.core.schedule_table import torch_order

    ours, torchs = Schedule("zbv", ranks, microbatches), torch_order("ZBVZeroBubble", ranks, microbatches)
    for rank in range(ranks):
        assert ours.actions(rank) == torchs.actions(rank)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (4, 2), (4, 4), (8, 8)])
def test_zbv_keeps_the_rule_of_thumb_when_the_v_cannot_fill(ranks: int, microbatches: int) -> None:
    # With no more micro-batches than ranks the pattern leaves holes that the rule of thumb fills.
    from pipe.core.schedule_table import TableSchedule

    ours = Schedule("zbv", ranks, microbatches)
    programs = [pipe.core.zero_bubble._v_pattern(rank, ranks, microbatches) for rank in range(ranks)]
    pattern = TableSchedule.from_table(programs)
    assert max(idle(ours, 1.0, 1.0, 1.0)) < max(idle(pattern, 1.0, 1.0, 1.0))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8])
def test_zbv_idles_ranks_minus_one_phases_once_the_v_fills(ranks: int) -> None:
    for microbatches in range(2 * ranks - 1, 4 * ranks + 1):
        assert max(idle(Schedule("zbv", ranks, microbatches), 1.0, 1.0, 1.0)) == pytest.approx(ranks - 1)
