"""Schedules given as tables on 2 gloo ranks against the plain module: torch's DualPipeV and interleaved
zero-bubble orders (2 stages per rank, I/W and, in DualPipeV, whole B's), every checkpoint mode, and a
1F1B table of the user's own, both also with receives posted 0 to 3 actions ahead per rank; a table for another
size is refused with the fix."""
from __future__ import annotations

import pytest

from dist_models import blocks, check_table_steps
from pipe.core.schedule_table import TableSchedule, torch_order
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks


def _tables(rank: int, world: int) -> list[str]:
    checked = []
    tables = [torch_order("DualPipeV", 2, 4), torch_order("InterleavedZeroBubble", 2, 4),
              torch_order("ZBVZeroBubble", 2, 4),
              TableSchedule.from_table([["F0@0", "F1@0", "F2@0", "B0@0", "F3@0", "B1@0", "B2@0", "B3@0"],
                                        ["F0@1", "B0@1", "F1@1", "B1@1", "F2@1", "B2@1", "F3@1", "B3@1"]])]
    tables += [tables[0].with_posts([3, 0]), tables[3].with_posts([0, 2])]
    for table in tables:
        for checkpoint in ("always", "except_last", "never"):
            check_table_steps(rank, table, checkpoint, f"{table}/{checkpoint}")
            checked.append(f"{table.name}{table.posts or ''}/{checkpoint}")
    with pytest.raises(ValueError, match=r"is for 2 ranks and 4 micro-batches.*pass chunks=4"):
        DistributedPipe(blocks(8), chunks=8, schedule=tables[0])
    return checked


def test_tables_run_and_match_the_plain_module() -> None:
    names = ["torch DualPipeV", "torch InterleavedZeroBubble", "torch ZBVZeroBubble", "table", "torch DualPipeV(3, 0)",
             "table(0, 2)"]
    expected = [f"{n}/{c}" for n in names for c in ("always", "except_last", "never")]
    assert run_ranks(_tables, 2, deadline=180) == [expected, expected]
