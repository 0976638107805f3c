"""Schedules given as tables: the Python and CSV forms, torch's orders as tables, and refused tables."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from pipe.core.program_time import time_schedule
from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule
from pipe.core.schedule_table import TableSchedule, torch_order
from pipe.viz.cli import main as pipe_viz

ONE_F_ONE_B = [["F0@0", "F1@0", "B0@0", "B1@0"], ["F0@1", "B0@1", "F1@1", "B1@1"]]


def test_python_and_csv_forms_give_the_same_schedule() -> None:
    table = TableSchedule.from_table(ONE_F_ONE_B, name="mine")
    assert (table.ranks, table.stages, table.microbatches, table.placement) == (2, 2, 2, (0, 1))
    # The same programs as the built-in 1F1B: the same simulation.
    built_in = Schedule("1f1b", 2, 2)
    assert [table.actions(r) for r in range(2)] == [built_in.actions(r) for r in range(2)]
    assert time_schedule(table) == time_schedule(built_in)
    assert table.bubble_fraction() == built_in.bubble_fraction()
    again = TableSchedule.from_csv(io.StringIO(table.to_csv()), name="mine")
    assert again == table
    assert table.to_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"  # torch's compute_only notation
    tuples = TableSchedule.from_table([[("F", 0, 0), ("F", 1, 0), Action(Phase.BACKWARD, 0, 0), "0B1"],
                                       ["F0@1", "B0@1", "F1@1", "B1@1"]], name="mine")
    assert tuples == table


@pytest.mark.parametrize("name", ["DualPipeV", "InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8)])
def test_torch_orders_are_valid_tables(name: str, ranks: int, microbatches: int) -> None:
    table = torch_order(name, ranks, microbatches)
    assert table.stages == 2 * ranks and table.splits_backward
    if name in ("DualPipeV", "ZBVZeroBubble"):  # a V: rank r holds stages r and 2p-1-r
        assert table.placement == tuple(min(s, 2 * ranks - 1 - s) for s in range(2 * ranks))
    else:  # looped: stage s on rank s % p
        assert table.placement == tuple(s % ranks for s in range(2 * ranks))
    for rank in range(ranks):  # every cell's F, I and W, each once
        assert len(table.actions(rank)) == 3 * 2 * microbatches
    assert 0 <= table.bubble_fraction() < Schedule("1f1b", ranks, microbatches).bubble_fraction()


@pytest.mark.parametrize("table,message", [
    ([["F0@0", "I0@0"], ["F0@1", "I0@1", "W0@1"]], r"rank 0 runs I0@0 but never its W \(W0@0\)"),
    ([["F0@0", "B0@0"], ["B0@1", "F0@1"]], r"rank 1 runs B0@1 before F0@1"),
    ([["F0@0", "F1@0", "B0@0", "B1@0"], ["F0@1", "B0@1", "B1@1"]], r"F1@1 is missing"),
    ([["F0@0", "B0@0", "F1@0", "B1@0"], ["F0@1", "F1@1", "B1@1", "B0@1"]],
     r"deadlocks: rank 0 at B0@0 \(waits for B0@1\); rank 1 at F1@1 \(waits for F1@0\): "
     r"the ranks wait for each other, first at B0@0"),
    ([["F0@0", "I0@0", "F0@3", "I0@3", "W0@3", "W0@0"], ["F0@1", "F0@2", "I0@2", "I0@1", "W0@1", "W0@2"]],
     r"deadlocks: rank 0 at I0@0 \(waits for I0@1\); rank 1 at I0@2 \(waits for I0@3\)"),
    ([["F0@0", "B0@0", "F0@1"], ["B0@1"]], r"rank 1 runs B0@1 but stage 1 runs on rank 0 \(F0@1\)"),
    ([["F0@0", "X0@0"]], r"'X0@0' is not an action"),
    ([["F0@0", "B0@0"], ["F0@2", "B0@2"]], r"no rank runs stage 1"),
])
def test_invalid_tables_name_their_first_bad_action(table: list[list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableSchedule.from_table(table)


def test_a_table_built_by_hand_is_checked_as_every_schedule_is() -> None:
    """A table's fields are checked when it is made, not only by from_table: the sizes as any schedule's, and
    programs, posts and placement agreeing with them."""
    table = TableSchedule.from_table([["F0@0", "B0@0"]])
    programs, placement = table.programs, table.placement
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        TableSchedule("table", 1, 0, 1, programs, placement)
    with pytest.raises(ValueError, match="2 programs and 0 post counts for 1 ranks"):
        TableSchedule("table", 1, 1, 1, programs * 2, placement)
    with pytest.raises(ValueError, match=r"placement \[3\] does not put each stage on one of 1 ranks"):
        TableSchedule("table", 1, 1, 1, programs, (3,))
    assert TableSchedule("table", 1, 1, 1, programs, placement) == table


def test_unmeetable_dependency_on_one_rank() -> None:
    # Rank 0 holds stages 0 and 3 of a V: its I0@3 needs its own F0@3, which comes later.
    table = [["F0@0", "I0@3", "F0@3", "W0@3", "I0@0", "W0@0"], ["F0@1", "F0@2", "I0@2", "W0@2", "I0@1", "W0@1"]]
    with pytest.raises(ValueError, match=r"rank 0 runs I0@3 before F0@3"):
        TableSchedule.from_table(table)


def test_pipe_viz_draws_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dualpipev.csv"
    path.write_text(torch_order("DualPipeV", 2, 4).to_csv())
    assert pipe_viz(["plan", "--table", str(path), "--checkpoint", "always"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dualpipev · 2 stages × 2 virtual · 4 micro-batches · checkpoint=always")
    assert " R" in out.split("\n")[2]  # checkpointed cells recompute before their I
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1B0,1F0\n")
    with pytest.raises(SystemExit) as exit_info:
        pipe_viz(["plan", "--table", str(bad)])
    assert exit_info.value.code == 2
    assert "rank 1 runs B0@1 before F0@1" in capsys.readouterr().err
