"""``pipe-plan`` and ``pipe-viz trace --explain``."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipe import Pipe, trace
from pipe.core.schedule_table import TableSchedule
from pipe.plan.cli import main as plan_main
from pipe.recompute import DEFAULT_SELECT
from pipe.viz.cli import main as viz_main

FACTORY = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4)])
'''


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cli_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return "cli_models:build"


def test_pipe_plan_prints_the_table_and_the_arguments(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = plan_main(["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2",
                        "--chunks", "1", "2", "4", "--explain"])
    out = capsys.readouterr().out
    assert status == 0
    assert "chosen" in out and "Pipe(model, chunks=" in out and "idle time explained" in out


GELU_FACTORY = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.proj(nn.functional.gelu(self.fc(x)))

def build():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])
'''


def test_pipe_plan_keeps_to_the_schedules_and_checkpoint_modes_given(factory: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2", "--runner",
            "processes", "--link", "none", "--chunks", "2", "4"]
    assert plan_main(args + ["--schedules", "zb-h1", "--checkpoints", "always"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " chunks=" in line and not line.startswith("DistributedPipe(")]
    assert rows and all("zb-h1 chunks=" in line and "checkpoint=always" in line for line in rows), rows
    assert "checkpoint='always', schedule='zb-h1'" in out, out
    with pytest.raises(SystemExit):
        plan_main(args + ["--schedules", "zb-h2"])
    assert "schedules ['zb-h2'] cannot run with runner='processes'" in capsys.readouterr().err


def test_pipe_plan_select_names_the_selective_recompute_to_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gelu_models.py").write_text(GELU_FACTORY)
    monkeypatch.chdir(tmp_path)
    seen = []

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["select"])
        return real(*args, **kwargs)

    searching = sys.modules["pipe.plan.planning"]  # the module (pipe.plan.plan is its function)
    real = searching.profile_costs
    monkeypatch.setattr(searching, "profile_costs", spy)
    common = ["--model", "gelu_models:build", "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2",
              "--chunks", "2"]
    for extra, expected in (([], DEFAULT_SELECT), (["--select"], ()), (["--select", r"fc", r"(.*\.)?gelu"],
                                                                       ("fc", r"(.*\.)?gelu"))):
        assert plan_main(common + extra) == 0
        assert tuple(seen[-1]) == expected
    with pytest.raises(SystemExit) as exit_:
        plan_main(common + ["--select", "mlp.("])
    assert exit_.value.code == 2 and "--select regex 'mlp.(' is not a valid regular expression" in capsys.readouterr().err


def test_pipe_plan_names_the_smallest_budget(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = plan_main(["--model", factory, "--input-shape", "16,16", "--budget", "1KiB", "--stages", "2",
                        "--chunks", "1", "2", "--runner", "processes", "--link", "none"])
    assert status == 1
    assert "raise memory_budget to at least" in capsys.readouterr().err


def test_pipe_plan_refuses_bad_arguments(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--budget", "lots"], "cannot read memory budget"),
                          (["--budget", "1GiB", "--input-shape", "16,x"], "sizes separated by commas"),
                          (["--budget", "1GiB", "--threads", "0"], "threads must be a positive number of intra-op "
                                                                   "threads, got 0")):
        base = ["--model", factory, "--input-shape", "16,16", "--stages", "2"]
        with pytest.raises(SystemExit) as exit_:
            plan_main(base + argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    # A wrong --model gets one line naming it, not the whole usage before it.
    assert plan_main(["--model", "no_such_module:build", "--input-shape", "4,16", "--budget", "1GiB",
                      "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipe-plan: cannot import 'no_such_module'") and "usage:" not in err, err


def test_pipe_plan_times_layers_on_the_threads_given(factory: str, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    search_module = sys.modules["pipe.plan.planning"]
    seen: list[Any] = []
    real = search_module.profile_costs
    monkeypatch.setattr(search_module, "profile_costs", lambda *a, **k: seen.append(k["threads"]) or real(*a, **k))
    common = ["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2", "--chunks", "1",
              "2", "--runner", "processes", "--link", "none"]
    assert plan_main(common + ["--threads", "2"]) == 0 and plan_main(common) == 0
    assert seen == [2, 1]  # given; else 1 for the process runner


def test_pipe_viz_trace_explains_a_recorded_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    piped = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"])
    with trace.record(tmp_path / "run.json", schedule="gpipe", checkpoint="except_last"):
        piped(torch.randn(8, 8)).sum().backward()
    piped.close()
    assert viz_main(["trace", str(tmp_path / "run.json"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "idle time explained (ms)" in out and "stage 1" in out
    assert json.loads((tmp_path / "run.json").read_text())["traceEvents"]


def test_pipe_plan_verify_prints_measured_beside_predicted(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Threads: Pipe on the CPU, the step timed; processes: one forked gloo rank per stage, peaks counted.
    for runner in ("threads", "processes"):
        status = plan_main(["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2",
                            "--chunks", "1", "2", "--runner", runner, "--link", "none", "--verify"])
        out = capsys.readouterr().out
        assert status == 0, out
        assert "verified (measured beside predicted):" in out and "measured" in out.split("verified")[1]
        assert "the fastest of 5 steps; median" in out, out  # the machine's own spread beside the figure
        assert ("rank 1 peak  predicted" in out) == (runner == "processes"), out
        assert "next best that fit:" in out and "slower by" in out


def test_pipe_plan_plans_orders_built_from_the_costs_on_request(factory: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--schedules auto: the order built from the plan's own costs; the suggested call reads its table back from
    CSV, and --verify runs that table on the ranks."""
    status = plan_main(["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2",
                        "--chunks", "2", "--runner", "processes", "--link", "none", "--schedules", "auto",
                        "--verify"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "* auto " in out and "table = TableSchedule.from_csv(io.StringIO(" in out, out
    assert "schedule=table" in out and "rank 1 peak  predicted" in out, out
    csv = out.split("io.StringIO(")[1].split("))")[0]
    table = TableSchedule.from_csv(io.StringIO(eval(csv)))  # the literal printed  # noqa: S307
    assert (table.ranks, table.microbatches) == (2, 2)


def test_pipe_plan_splits_ranks_between_pipeline_sharding_and_replicas(factory: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # 2 ranks: pp2 x dp_shard1 or pp1 x dp_shard2, each split with its line.
    common = ["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2", "--chunks", "1", "2",
              "4", "--runner", "processes", "--link", "none"]
    assert plan_main(common + ["--dp-shard", "auto"]) == 0
    out = capsys.readouterr().out
    assert "splits of the ranks (pp x dp_shard):" in out and "pp2 x dp_shard1 " in out and "pp1 x dp_shard2 " in out
    # --verify runs a sharded plan on 2 gloo processes, each rank against its pipeline rank's prediction.
    assert plan_main(common + ["--dp-shard", "2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "mesh = make_mesh(pp=1, dp_shard=2)" in out and "mesh=mesh" in out and "shard=Shard(" in out, out
    measured = [line for line in out.splitlines() if " peak  predicted" in line]
    assert len(measured) == 2 and all("(pipeline rank 0)" in line for line in measured), out
    # A layer at a time, reducing after each backward, as --unit and --reduce narrow it: run and counted alike.
    assert plan_main(common + ["--dp-shard", "2", "--unit", "block", "--reduce", "micro-batch", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "zero3 unit=block reduce=micro-batch" in out and "unit='block', reduce='micro-batch'" in out, out
    measured = [line for line in out.splitlines() if " peak  predicted" in line]
    assert len(measured) == 2 and all(abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) <= 1.0 for line in measured), out
    # Replicas: --dp-replicate 2 runs pp1 x dp_replicate2 (the averager's copies in each rank's peak).
    assert plan_main(common + ["--dp-replicate", "2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "splits of the ranks (pp x dp_replicate):" in out and "pp1 x dp_replicate2" in out, out
    assert "mesh = make_mesh(pp=1, dp_shard=1, dp_replicate=2)" in out and "shard=Shard" not in out, out
    measured = [line for line in out.splitlines() if " peak  predicted" in line]
    assert len(measured) == 2 and all("(pipeline rank 0)" in line for line in measured), out
    assert all(abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) <= 1.0 for line in measured), measured
    for bad, message in ((["--dp-shard", "3"], "dp_shard=[3] does not divide the 2 ranks"),
                         (["--dp-shard", "two"], "--dp-shard takes 'auto' or sizes"),
                         (["--dp-shard", "auto", "--runner", "threads"], "--dp-shard plans FSDP sharding"),
                         (["--dp-replicate", "2", "--runner", "threads"], "--dp-replicate plans data-parallel replicas"),
                         (["--dp-replicate", "3"], "dp_replicate=[3] does not divide the 2 ranks"),
                         (["--dp-shard", "2", "--unit", "layer"], "argument --unit: invalid choice: 'layer'")):
        args = ["--model", factory, "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2", "--link", "none"]
        if "--runner" not in bad:
            args += ["--runner", "processes"]
        with pytest.raises(SystemExit) as exited:
            plan_main(args + bad)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_verify_says_when_the_prediction_lies_within_the_measured_steps() -> None:
    from pipe.plan.cli import _step_line

    inside = _step_line(0.011, [0.012, 0.010, 0.015, 0.011, 0.013])
    assert "predicted     11.00 ms  measured     10.00 ms (+10.0%)\n" in inside, inside
    assert inside.endswith("the fastest of 5 steps; median 12.00 ms, slowest 15.00 ms: the prediction lies within them")
    outside = _step_line(0.009, [0.012, 0.010, 0.015])
    assert "(-10.0%)\n" in outside and outside.endswith("the fastest of 3 steps; median 12.00 ms, slowest 15.00 ms")
