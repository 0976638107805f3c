"""``pipe.plan.calibrate`` (pipe/plan/calibration.py): the time model read off and fitted to plans of the model run and recorded here, and ``plan(calibrate=True)``."""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipe.plan
from pipe.plan.calibration import CALIBRATION, calibrate, calibration_plans
from pipe.plan.candidates import candidates
from pipe.plan.cli import main as plan_main
from pipe.plan.predict import predict
from pipe.plan.timing import Link, TimeModel


def tanh_layers(layers: int = 6, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def costs_of(model: nn.Sequential, batch: int = 32) -> pipe.plan.Costs:
    return pipe.plan.profile_costs(model, torch.randn(batch, 64), (1, 2, 4, 8), rounds=2)


def test_calibration_plans_take_one_balanced_plan_per_schedule_family() -> None:
    # The last layer is the slow one (30x the others): the time-balanced split gives it a stage nearly alone.
    # Tabled costs, not timed ones: a loaded machine pausing one timing once hid it (balance (2, 4)).
    costs = pipe.plan.Costs.from_table(32, [1e-5] * 5 + [3e-4], [2e-5] * 5 + [6e-4], [256] * 6, [256] * 6,
                                       param_bytes=[16640] * 5 + [1 << 20])
    chosen = calibration_plans(candidates(costs, 2, "processes"), costs)
    assert [c.schedule for c in chosen] == [kind for kind, _, _ in CALIBRATION]
    assert [c.chunks for c in chosen] == [chunks for _, chunks, _ in CALIBRATION]
    assert all(not c.recompute and not c.selective() and c.dp_shard == 1 for c in chosen)
    one_f_one_b = chosen[1]
    assert one_f_one_b.balance[-1] <= 2, one_f_one_b.balance  # not [1, 5], the first balance in order
    assert calibration_plans([c for c in candidates(costs, 2, "processes") if c.schedule == "gpipe"], costs) \
        == [chosen[0]]


def test_calibrate_fits_the_model_no_worse_than_the_layers_times_alone() -> None:
    model = tanh_layers()
    x = torch.randn(32, 64)
    costs = costs_of(model)
    link = Link(latency=1e-4, per_byte=1e-9)
    calibration = calibrate(functools.partial(copy.deepcopy, model), costs, 2, x, link=link,
                            schedules=("gpipe", "1f1b", "interleaved"), sweeps=1, repeat=2)
    assert [c.schedule for c in calibration.measured] == ["gpipe", "1f1b", "interleaved"]
    assert all(t > 0 for t in calibration.measured.values())
    assert calibration.model.link == link

    def rms(model_time: TimeModel) -> float:
        errors = [predict(costs, c, runner="processes", timeline=False, model=model_time).step_time / t - 1
                  for c, t in calibration.measured.items()]
        return math.sqrt(sum(e * e for e in errors) / len(errors))

    # Each phase's compute was read off the plans' recorded steps, then the constants fitted to their step
    # times: the fit minimises exactly this error, starting from those phases alone, so it cannot end worse.
    assert calibration.model.phases != (1.0,) * 4 and all(v > 0 for v in calibration.model.phases)
    assert rms(calibration.model) <= rms(TimeModel(link=link, phases=calibration.model.phases)) + 1e-12
    assert rms(calibration.model) == pytest.approx(
        math.sqrt(sum(e * e for e in calibration.errors.values()) / 3))
    assert "calibrated on 3 plans run here" in calibration.describe()
    assert set(calibration.spread) == set(calibration.measured) and all(v >= 0 for v in calibration.spread.values())
    assert "over its fastest, at the median plan" in calibration.describe()


def test_calibrate_refuses_what_it_cannot_run() -> None:
    model = tanh_layers(layers=2)
    costs = costs_of(model)
    with pytest.raises(ValueError, match="no plan to calibrate on: 2 layers over 2 ranks with schedules"):
        calibrate(lambda: model, costs, 2, torch.randn(32, 64), schedules=("zbv",))
    four = candidates(costs_of(tanh_layers(layers=4)), 4, "processes", schedules=("gpipe",))[:1]
    with pytest.raises(ValueError, match="calibration plans must run on 2 pipeline ranks, without replicas or shards"):
        calibrate(lambda: model, costs, 2, torch.randn(32, 64), plans=four)
    replicated = [replace(c, dp_replicate=2) for c in candidates(costs, 1, "processes", schedules=("gpipe",))[:1]]
    with pytest.raises(ValueError, match="without replicas or shards"):
        calibrate(lambda: model, costs, 2, torch.randn(32, 64), plans=replicated)
    with pytest.raises(ValueError, match="sweeps and repeat must be >= 1, got sweeps=0"):
        calibrate(lambda: model, costs, 2, torch.randn(32, 64), sweeps=0)
    sample = torch.randn(32, 64)
    with pytest.raises(ValueError, match="calibrate=True runs plans on local processes.*runner='processes'"):
        pipe.plan.plan(model, sample, memory_budget="1GiB", stages=2, calibrate=True)
    with pytest.raises(ValueError, match="either model_time= .* or calibrate=True"):
        pipe.plan.plan(model, sample, memory_budget="1GiB", stages=2, runner="processes", calibrate=True,
                       model_time=TimeModel())


FACTORY = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4)])
'''


def test_pipe_plan_calibrate_plans_with_the_fitted_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "calibrate_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    common = ["--model", "calibrate_models:build", "--input-shape", "16,16", "--budget", "16MiB", "--stages", "2",
              "--chunks", "1", "2", "4", "--link", "none"]
    with pytest.raises(SystemExit) as exit_info:
        plan_main(common + ["--calibrate"])
    assert exit_info.value.code == 2
    assert "--calibrate runs plans on local processes" in capsys.readouterr().err
    assert plan_main(common + ["--runner", "processes", "--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on 5 plans run here (rms error" in out, out
    assert "time model: no transfer cost; overhead" in out and "DistributedPipe(model, chunks=" in out


def test_where_a_gpu_is_visible_the_plans_ranks_are_fresh_interpreters_so_build_must_pickle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A forked child can use neither CUDA nor autograd once the parent did (torch refuses); ranks in fresh
    # interpreters get build by pickling, and a lambda does not pickle: refused before any process starts.
    from pipe.plan.measure import run_plans

    model = tanh_layers(layers=2)
    plans = candidates(costs_of(model), 2, "processes", schedules=("gpipe",))[:1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(TypeError, match="the plan's ranks are fresh interpreters .* build and loss_fn must be functions at module level"):
        run_plans(lambda: model, plans, torch.randn(32, 64), torch.randn(32, 64), nn.functional.mse_loss)
    with pytest.raises(ValueError, match="run_plans runs candidates on one set of ranks"):
        run_plans(lambda: model, [], torch.randn(32, 64), None, nn.functional.mse_loss)


def _two_layers() -> nn.Sequential:  # at module level: the plans' ranks may be fresh interpreters
    return tanh_layers(layers=2)


def test_run_plans_keeps_every_timed_step_of_every_sweep_and_the_fastest() -> None:
    from pipe.plan.measure import run_plans

    plans = candidates(costs_of(_two_layers()), 2, "processes", schedules=("gpipe",))[:2]
    measured = run_plans(_two_layers, plans, torch.randn(32, 64), torch.randn(32, 64), nn.functional.mse_loss,
                         repeat=2, sweeps=3)
    for ranks in measured:
        for m in ranks:
            assert len(m.step_times) == 6 and m.step_time == min(m.step_times), m
            assert m.activation_peak > 0


def test_calibrate_warns_when_the_machine_s_speed_moved_under_the_plans(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    import pipe.plan.calibration as calibration_module
    from pipe.balance.traced import TracedStep
    from pipe.plan.measure import Measured
    nan = math.nan

    model = tanh_layers(layers=2)
    costs = costs_of(model)
    plans = candidates(costs, 2, "processes", schedules=("gpipe",))[:2]

    def steady_or_not(spread: float) -> Any:
        def run(build: Any, chosen: Any, *args: Any, **kwargs: Any) -> list[list[Measured]]:
            times = (0.010, 0.010 * (1 + spread), 0.010 * (1 + 2 * spread))
            return [[Measured(1, 0.010, 0, times), Measured(1, 0.010, 1, times)] for _ in chosen]
        return run

    def recorded(traces: Any, balance: Any) -> TracedStep:  # the fake plans' steps, as recorded
        n = len(balance)
        return TracedStep(tuple(balance), (1e-3,) * n, (nan,) * n, (nan,) * n, (2e-3,) * n, 1e-4, 0.010, 3)

    monkeypatch.setattr(calibration_module, "traced_step", recorded)
    monkeypatch.setattr(calibration_module, "run_plans", steady_or_not(0.5))
    with caplog.at_level("WARNING", logger="pipe.plan.calibration"):
        moved = calibrate(lambda: model, costs, 2, torch.randn(32, 64), plans=plans)
    assert moved.spread == {c: pytest.approx(0.5) for c in plans}
    assert "a plan's median step ran 50% over its fastest" in caplog.text and "calibrate with nothing else" in caplog.text
    assert "a plan's median step +50.0% over its fastest" in moved.describe()
    caplog.clear()
    monkeypatch.setattr(calibration_module, "run_plans", steady_or_not(0.05))
    with caplog.at_level("WARNING", logger="pipe.plan.calibration"):
        steady = calibrate(lambda: model, costs, 2, torch.randn(32, 64), plans=plans)
    assert steady.spread == {c: pytest.approx(0.05) for c in plans} and not caplog.text
