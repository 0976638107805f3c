"""pipe.trace on the process runner: one trace file per rank, merged onto one clock and drawn."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from dist_models import batch, blocks
from pipe import trace
from pipe.balance import traced_step
from pipe.distributed import DistributedPipe
from pipe.viz.cli import main as pipe_viz
from pipe.viz.measured import from_trace
from spawn_ranks import run_ranks


def _record(rank: int, world: int, directory: str) -> int:
    pipe = DistributedPipe(copy.deepcopy(blocks(4)), chunks=4, checkpoint="except_last", schedule="1f1b",
                           loss_fn=F.mse_loss)
    inputs, target = batch(8)
    pipe.step(inputs, target)  # warm-up, not recorded
    with trace.record(Path(directory) / "run.{rank}.json", rank=rank, schedule="1f1b", checkpoint="except_last"):
        pipe.step(inputs, target)
    return rank


def test_each_rank_records_a_file_and_the_files_merge(tmp_path: Path) -> None:
    assert run_ranks(_record, 2, str(tmp_path)) == [0, 1]
    files = [tmp_path / f"run.{rank}.json" for rank in range(2)]
    merged = trace.merge(files)
    timeline = from_trace(merged)
    assert timeline.rows == ["rank 0", "rank 1"]
    for row in range(2):
        counts = {kind: timeline.count(row, kind) for kind in ("forward", "backward", "recompute")}
        assert counts == {"forward": 4, "backward": 4, "recompute": 3}, (row, counts)
    # Activations go 0 -> 1 and gradients 1 -> 0: each rank sends and receives once per micro-batch.
    assert timeline.count(0, "send") == timeline.count(1, "recv") == 4
    assert timeline.count(1, "send") == timeline.count(0, "recv") == 4
    # On one clock: rank 1's first forward starts after rank 0's first forward ended.
    f0 = min((c for c in timeline.cells if c.row == 0 and c.kind == "forward"), key=lambda c: c.start)
    f1 = min((c for c in timeline.cells if c.row == 1 and c.kind == "forward"), key=lambda c: c.start)
    assert f0.end <= f1.start
    assert timeline.title.startswith("measured 1F1B · 2 ranks · 4 micro-batches · checkpoint=except_last")
    assert pipe_viz(["trace", *map(str, files), "--plan", "-o", str(tmp_path / "run.svg")]) == 0


def _record_sharded(rank: int, world: int, directory: str) -> int:
    from pipe.distributed import Shard, make_mesh

    pipe = DistributedPipe(copy.deepcopy(blocks(4)), chunks=2, checkpoint="never", schedule="1f1b",
                           mesh=make_mesh(pp=2, dp_shard=2), shard=Shard(unit="stage"), loss_fn=F.mse_loss)
    inputs, target = batch(4)  # each shard partner its own rows: the same ones will do for a trace
    pipe.step(inputs, target)  # warm-up, not recorded
    with trace.record(Path(directory) / "run.{rank}.json", rank=rank, schedule="1f1b"):
        pipe.step(inputs, target)
    return rank


def test_fsdp_gathers_and_reduces_are_recorded_under_the_plans_names(tmp_path: Path) -> None:
    """The lowered program's UNSHARD, WAIT_UNSHARD and REDUCE_GRAD steps (a stage gathered whole, unit="stage": the
    runner's own) are spans named as pipe-viz plan names them."""
    assert run_ranks(_record_sharded, 4, str(tmp_path)) == [0, 1, 2, 3]
    timeline = from_trace(trace.load(tmp_path / "run.0.json"))
    # Rank 0 holds stage 0: gathered once (issued and waited for), reduced once after its last backward.
    assert timeline.count(0, "gather") == 2 and timeline.count(0, "reduce") == 1, timeline.counts()
    reduce = next(c for c in timeline.cells if c.kind == "reduce")
    last_backward = max((c for c in timeline.cells if c.kind == "backward"), key=lambda c: c.end)
    assert reduce.start >= last_backward.end - 1e-6


_TRACE_CLOCK: list[int] = [0]  # this rank's fake trace clock, in ns: only the loss moves it


def _slow_loss(output, target):  # type: ignore[no-untyped-def]
    _TRACE_CLOCK[0] += 30_000_000  # 30 ms of the trace's clock
    return F.mse_loss(output, target)


def _record_loss(rank: int, world: int) -> list[float]:
    import types

    import pipe.trace.recorder as recorder_module

    pipe = DistributedPipe(copy.deepcopy(blocks(4)), chunks=2, checkpoint="never", schedule="1f1b",
                           loss_fn=_slow_loss)
    inputs, target = batch(8)
    pipe.step(inputs, target)
    # The recorder reads a fake clock that only the loss moves: every other span lasts 0, the gaps between them 0.
    recorder_module.time = types.SimpleNamespace(perf_counter_ns=lambda: _TRACE_CLOCK[0], time_ns=time.time_ns)
    try:
        with trace.record(None, rank=rank) as recorder:
            pipe.step(inputs, target)
    finally:
        recorder_module.time = time
    traces: list[object] = [None] * world
    dist.all_gather_object(traces, recorder.trace())
    step = traced_step(traces, balance=[2, 2])  # type: ignore[arg-type]
    return [step.forward[1], step.overhead]


def test_the_last_stages_loss_is_recorded_in_its_forward_not_as_the_runners_time() -> None:
    """A loss of 30 ms is the last stage's cost: an order from the recorded costs must charge it to that stage,
    not spread it over every rank's actions as the runner's own time. (Recorded by a fake clock that only the loss
    moves: by the wall clock, a pause of the machine between two actions counted as the runner's time.)"""
    for forward_last, overhead in run_ranks(_record_loss, 2):
        assert forward_last == pytest.approx(0.03), forward_last
        assert overhead == pytest.approx(0.0, abs=1e-12), overhead  # outside the forward: 60 ms over 3 gaps of rank 1
