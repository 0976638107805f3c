"""Zero-bubble schedules on gloo ranks against the plain module: ZB-H1 (2 ranks) and ZB-V (2 ranks x 2 stages),
every checkpoint mode, each checkpointed cell recomputed exactly once (counted)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pipe
from dist_models import WIDTH, Block, Head, batch, blocks, check_against_oracle, skip_model
from pipe import trace
from pipe.core.options import checkpoint_stop
from pipe.distributed import DistributedPipe, make_mesh, state
from pipe.viz.cli import main as pipe_viz
from pipe.viz.measured import from_trace
from spawn_ranks import run_ranks

CHECKPOINTS = ("always", "except_last", "never")


class CountedBlock(Block):
    """A :class:`Block` with dropout (so a recompute must replay the random state) that counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.25)
        self.calls = {"forward": 0, "recompute": 0}

    def forward(self, value: tuple[Tensor, dict[str, Any]]) -> tuple[Tensor, dict[str, Any]]:
        self.calls["recompute" if pipe.is_recomputing() else "forward"] += 1
        x, info = super().forward(value)
        return self.dropout(x), info


def counted_model(layers: int = 8) -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(*[CountedBlock() for _ in range(layers - 1)], Head())


def _check(rank: int, world: int, schedule: str) -> list[tuple[str, int, int]]:
    chunks, size = 4, 10  # an uneven last micro-batch: 10 = 3 + 3 + 2 + 2
    seen = []
    for checkpoint in CHECKPOINTS:
        model = counted_model()
        dist_pipe = DistributedPipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint,
                                    schedule=schedule, loss_fn=F.mse_loss)
        expected_stages = [rank] if schedule == "zb-h1" else [rank, 2 * world - 1 - rank]
        assert dist_pipe.stages == sorted(expected_stages)
        inputs, target = batch(size, seed=3)
        torch.manual_seed(11)  # the same dropout masks as the oracle's, micro-batch by micro-batch
        loss = dist_pipe.step(inputs, target)
        # The oracle: the plain module run micro-batch by micro-batch with the same random stream is
        # not the pipeline's order of draws, so compare with dropout off, and count with it on.
        counted = [m for m in dist_pipe.modules() if isinstance(m, CountedBlock)]
        assert counted
        recomputes = {m.calls["recompute"] for m in counted}
        forwards = {m.calls["forward"] for m in counted}
        assert forwards == {chunks}, (schedule, checkpoint, forwards)
        # Exactly once per checkpointed cell: micro-batches i < checkpoint_stop, each recomputed once.
        assert recomputes == {checkpoint_stop(checkpoint, chunks)}, (schedule, checkpoint, recomputes)
        assert loss is None or torch.isfinite(loss)
        seen.append((checkpoint, min(forwards), min(recomputes)))

        for m in dist_pipe.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        plain = copy.deepcopy(model)
        for m in plain.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        for size_, seed in ((10, 0), (7, 1)):
            inputs, target = batch(size_, seed)
            dist_pipe.zero_grad()
            loss = dist_pipe.step(inputs, target)
            check_against_oracle(dist_pipe, plain, inputs, target, loss, f"{schedule}/{checkpoint}/B={size_}")
    return seen


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_matches_plain_module_and_recomputes_once(schedule: str) -> None:
    results = run_ranks(_check, 2, schedule)
    for per_rank in results:
        assert per_rank == [("always", 4, 4), ("except_last", 4, 3), ("never", 4, 0)]


def _skips(rank: int, world: int) -> int:
    checked = 0
    # zbv on 2 ranks: stages 0 1 2 3 on ranks 0 1 1 0; a skip from stage 0 to stage 3 stays on rank 0,
    # one from stage 0 to stage 2 crosses to rank 1.
    for model in (skip_model(1, 7, 8), skip_model(1, 5, 8)):
        for checkpoint in CHECKPOINTS:
            dist_pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule="zbv")
            generator = torch.Generator().manual_seed(checked)
            x = torch.randn(10, WIDTH, generator=generator)
            target = torch.randn(10, WIDTH, generator=generator)
            loss = dist_pipe.step(x, target, F.mse_loss)
            check_against_oracle(dist_pipe, model, x, target, loss, f"skip zbv/{checkpoint}")
            checked += 1
    return checked


def test_skips_under_zbv() -> None:
    assert run_ranks(_skips, 2) == [6, 6]


def _recompute_policy(rank: int, world: int, schedule: str) -> list[int]:
    """pipe.recompute's per-layer marks sit on torch.utils.checkpoint, which recomputes on every walk of
    its graph: once for I and once more for W. Gradients stay those of the plain module."""
    model = counted_model()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    marked = copy.deepcopy(model)
    for block in marked:
        if isinstance(block, CountedBlock):
            pipe.recompute.recompute(block)
    dist_pipe = DistributedPipe(marked, chunks=4, checkpoint="never", schedule=schedule)
    inputs, target = batch(10, 4)
    loss = dist_pipe.step(inputs, target, F.mse_loss)
    check_against_oracle(dist_pipe, model, inputs, target, loss, f"recompute policy {schedule}")
    return sorted({m.calls["recompute"] for m in dist_pipe.modules() if isinstance(m, CountedBlock)})


def test_recompute_policies_give_plain_gradients_and_recompute_per_graph_walk() -> None:
    # Recomputations per marked block in one step of 4 micro-batches: 1F1B walks each graph once.
    assert run_ranks(_recompute_policy, 2, "1f1b") == [[4], [4]]
    # ZB-V walks it for I and again for W: twice, except on stage 0 (rank 0), whose input needs
    # no gradient, so that its I is empty and W is the one walk.
    assert run_ranks(_recompute_policy, 2, "zbv") == [[4, 8], [8]]


def _record(rank: int, world: int, directory: str) -> int:
    dist_pipe = DistributedPipe(copy.deepcopy(counted_model()), chunks=4, checkpoint="always", schedule="zbv",
                                loss_fn=F.mse_loss)
    inputs, target = batch(8)
    dist_pipe.step(inputs, target)  # warm-up, not recorded
    with trace.record(Path(directory) / "run.{rank}.json", rank=rank, schedule="zbv", checkpoint="always"):
        dist_pipe.step(inputs, target)
    return rank


def test_trace_records_input_and_weight_spans(tmp_path: Path) -> None:
    assert run_ranks(_record, 2, str(tmp_path)) == [0, 1]
    files = [tmp_path / f"run.{rank}.json" for rank in range(2)]
    timeline = from_trace(trace.merge(files))
    for row in range(2):  # two stages per rank, 4 micro-batches: 8 cells, each F, R (once), I, W
        counts = {kind: timeline.count(row, kind) for kind in ("forward", "recompute", "input", "weight", "backward")}
        assert counts == {"forward": 8, "recompute": 8, "input": 8, "weight": 8, "backward": 0}, (row, counts)
    for row in range(2):  # each cell's recompute ends before its I starts, and its I before its W
        cells = {(c.kind, c.microbatch, c.stage): c for c in timeline.cells if c.row == row}
        for (kind, i, s), c in cells.items():
            if kind == "input":
                assert cells[("recompute", i, s)].end <= c.start <= c.end <= cells[("weight", i, s)].start
    assert pipe_viz(["trace", *map(str, files), "--plan", "-o", str(tmp_path / "run.svg")]) == 0


def _replicas(rank: int, world: int) -> list[str]:
    checked = []
    mesh = make_mesh(pp=2, dp_replicate=2)  # stage 0's replicas on ranks 0 and 1, stage 1's on 2 and 3
    for schedule in ("zb-h1", "zbv"):  # 2 pipeline ranks x 2 replicas; W's gradients are averaged
        model = blocks(8)
        dist_pipe = DistributedPipe(copy.deepcopy(model), chunks=2, checkpoint="except_last", schedule=schedule,
                                    mesh=mesh)
        inputs, target = batch(24, seed=5)
        rows = slice(dist_pipe.topology.replica * 12, (dist_pipe.topology.replica + 1) * 12)
        mine = (inputs[0][rows], {"scale": inputs[1]["scale"], "ids": inputs[1]["ids"][rows]})
        loss = dist_pipe.step(mine, target[rows], F.mse_loss, broadcast_loss=True)
        check_against_oracle(dist_pipe, model, inputs, target, loss, f"{schedule} x 2 replicas")
        checked.append(f"{schedule}:{dist_pipe.topology.replica}/{dist_pipe.stages}")
    return checked


def test_pipeline_x_data_parallel() -> None:
    assert run_ranks(_replicas, 4, deadline=120.0) == [
        ["zb-h1:0/[0]", "zbv:0/[0, 3]"], ["zb-h1:1/[0]", "zbv:1/[0, 3]"],
        ["zb-h1:0/[1]", "zbv:0/[1, 2]"], ["zb-h1:1/[1]", "zbv:1/[1, 2]"],
    ]


def _resume_in_a_v(rank: int, world: int, path: str) -> tuple[list[float], list[float]]:
    from test_state import _model, _train

    # Saved from ZB-H1 (stage r on rank r), resumed into ZB-V (rank 0: stages 0 and 3, rank 1: 1 and 2).
    first = DistributedPipe(_model(0), chunks=2, checkpoint="always", schedule="zb-h1")
    optimizer = torch.optim.Adam(first.parameters(), lr=0.01)
    _train(first, optimizer, range(2))
    state.save(path, first, optimizer, step=2)
    reference = _train(first, optimizer, range(2, 4))
    resumed = DistributedPipe(_model(1), chunks=2, checkpoint="always", schedule="zbv")
    optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    assert state.load(path, resumed, optimizer) == {"step": 2}
    return reference, _train(resumed, optimizer, range(2, 4))


def test_stage_agnostic_checkpoint_resumes_in_a_v(tmp_path: Path) -> None:
    (reference, resumed), again = run_ranks(_resume_in_a_v, 2, str(tmp_path / "checkpoint"))
    assert again == (reference, resumed)
    assert resumed == pytest.approx(reference, rel=1e-6)


def _bytes_after_weights(rank: int, world: int) -> list[tuple[str, int, int]]:
    """Live activation bytes after each W of a ZB-H1 step, and the bytes one forward of the stage keeps."""
    from pipe.recompute.memory import ActivationMemory

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    piped = DistributedPipe(model, chunks=4, schedule="zb-h1", checkpoint="never", loss_fn=F.mse_loss)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    piped.step(x, y)
    seen: list[tuple[str, int, int]] = []

    from pipe.core.lowering import Kind

    executors = piped._runtime.executors
    weight = executors[Kind.WEIGHT]

    def spy(step: Any) -> None:  # the bytes alive around each W
        seen.append((str(step.action), 0, memory.live_bytes))
        weight(step)
        seen.append((str(step.action), 1, memory.live_bytes))

    with ActivationMemory() as memory:
        executors[Kind.WEIGHT] = spy
        piped.step(x, y)
    return seen


def test_a_weight_action_lets_its_micro_batch_go_at_once() -> None:
    """W frees its micro-batch's graph when it ends: the runner kept it one W longer (a fifth of ZB-H1's peak)."""
    for rank, seen in enumerate(run_ranks(_bytes_after_weights, 2)):
        before = {action: live for action, when, live in seen if when == 0}
        after = {action: live for action, when, live in seen if when == 1}
        freed = before[f"W0@{rank}"] - after[f"W0@{rank}"]
        # The first W frees what micro-batch 0's graph saved for it: its stage's 2 layers saved 4 tensors of
        # 16 rows x 256 x 4 B (the runner used to keep them until the next W; then it freed 1 tensor's worth).
        assert freed >= 3 * 16 * 256 * 4, (rank, freed, seen)
