"""The search: the fastest plan that fits, on cost tables whose best plan is known."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipe.core.schedule_table import TableSchedule
from pipe.plan import Candidate, Costs, Link, PlanError, TimeModel, parse_bytes, predict, search
from pipe.core.units import format_bytes
from pipe.plan.candidates import candidates, per_stage_offload, per_stage_recompute
from pipe.plan.predict import predict_memory
from pipe.recompute import DEFAULT_SELECT


def table(forward: list[float], overhead: float = 0.0, batch: int = 8) -> Costs:
    n = len(forward)
    return Costs.from_table(batch, forward, [2 * f for f in forward], [1000] * n, [40] * n,
                            param_bytes=[100] * n, overhead=overhead)


def test_without_a_memory_limit_the_most_micro_batches_without_recompute_win() -> None:
    # No per-micro-batch overhead: the bubble (S - 1) / (M + S - 1) shrinks with M, recomputing only costs.
    plan = search(table([1e-3] * 4), 2, "1GiB")
    assert plan.candidate == Candidate("gpipe", 8, (2, 2), "never")


def test_a_heavy_layer_gets_a_stage_of_its_own() -> None:
    plan = search(table([1e-3, 1e-3, 1e-3, 6e-3]), 2, "1GiB")
    assert plan.candidate.balance == (3, 1)


def test_per_micro_batch_overhead_favours_fewer_micro_batches() -> None:
    # 5 ms per layer and micro-batch whatever its size dwarfs the work (1 us per sample).
    plan = search(table([1e-6] * 4, overhead=5e-3), 2, "1GiB")
    assert plan.candidate.chunks == 1


def test_a_tight_budget_chooses_1f1b_over_gpipe_at_the_same_speed() -> None:
    costs = table([1e-3] * 4)
    gpipe = predict(costs, Candidate("gpipe", 8, (2, 2), "never"), runner="processes")
    one = predict(costs, Candidate("1f1b", 8, (2, 2), "never"), runner="processes")
    assert one.step_time == pytest.approx(gpipe.step_time) and one.peak < gpipe.peak
    plan = search(costs, 2, one.peak, runner="processes", schedules=["gpipe", "1f1b"])
    assert plan.candidate == Candidate("1f1b", 8, (2, 2), "never")
    assert all(p.peak <= one.peak for p, _ in plan.runners_up)


def test_faster_plans_are_rejected_with_the_rank_that_overflows() -> None:
    costs = table([1e-3] * 4)
    never = predict(costs, Candidate("gpipe", 8, (2, 2), "never"))
    plan = search(costs, 2, never.peak - 1)
    assert plan.best.step_time >= never.step_time
    assert plan.rejected and all(p.step_time <= plan.best.step_time for p, _ in plan.rejected)
    for p, why in plan.rejected:
        assert p.peak > never.peak - 1 and "rank" in why and "needs" in why
    assert all(p.peak <= never.peak - 1 and p.step_time >= plan.best.step_time and why.startswith("slower by")
               for p, why in plan.runners_up)
    assert "chosen" in plan.table() and "over budget" in plan.table()


def test_an_impossible_budget_names_the_smallest_that_fits() -> None:
    costs = table([1e-3] * 4)
    smallest = min(predict(costs, c).peak for c in candidates(costs, 2))
    with pytest.raises(PlanError, match=f"{smallest} bytes\\) on rank [01] \\(stage [01]: layers "):
        search(costs, 2, 10)
    assert search(costs, 2, smallest).best.peak == smallest


def test_budgets_are_read_in_units() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes(4096) == 4096
    for bad in ("two gigs", "-1", 0, "1 parsec", True):
        with pytest.raises(ValueError, match="memory budget"):
            parse_bytes(bad)  # type: ignore[arg-type]


def test_plans_become_front_end_arguments() -> None:
    costs = table([1e-3] * 4)
    plan = search(costs, 2, "1GiB", runner="processes")
    kwargs = plan.distributed_kwargs()
    assert set(kwargs) == {"chunks", "balance", "checkpoint", "schedule", "virtual_stages"}
    threads = search(costs, 2, "1GiB")
    assert threads.pipe_kwargs() == {"chunks": 8, "balance": [2, 2], "checkpoint": "never"}
    if plan.candidate.schedule != "gpipe":
        with pytest.raises(ValueError, match="DistributedPipe"):
            plan.pipe_kwargs()


def test_bad_search_arguments_are_named() -> None:
    costs = table([1e-3] * 4)
    with pytest.raises(ValueError, match="runner"):
        search(costs, 2, "1GiB", runner="gpu")
    with pytest.raises(ValueError, match="cannot run with runner='threads'"):
        search(costs, 2, "1GiB", schedules=["1f1b"])
    with pytest.raises(ValueError, match="between 1 and 4"):
        search(costs, 5, "1GiB")
    with pytest.raises(ValueError, match="2 entries for 3 ranks"):
        search(costs, 3, ["1GiB", "1GiB"])


def test_a_budget_between_never_and_always_gets_per_stage_recompute() -> None:
    # Rank 0 holds more micro-batches in 1F1B than rank 1: only its stage needs marked layers.
    costs = table([1e-3] * 8)
    never = predict(costs, Candidate("1f1b", 8, (4, 4), "never"), runner="processes")
    budget = [never.peaks[0] - 1000 * 2, never.peaks[1]]  # two layers' activations of one micro-batch short
    plan = search(costs, 2, budget, runner="processes", schedules=["1f1b"], balances=[(4, 4)])
    chosen = plan.candidate
    assert chosen.checkpoint == "never" and chosen.recompute and chosen.recompute[1] == 0
    assert 0 < chosen.recompute[0] < 4, chosen
    assert all(p <= b for p, b in zip(plan.best.peaks, budget))
    uniform = search(costs, 2, budget, runner="processes", schedules=["1f1b"], balances=[(4, 4)], per_stage=False)
    assert plan.best.step_time < uniform.best.step_time  # recomputing some layers of one stage beats a mode for all
    assert plan.distributed_kwargs()["recompute"] == {"recompute_config": {"recompute": list(chosen.recompute)}}
    assert "recompute=" in plan.table()
    # Budgets that differ per rank are printed in rank order.
    assert plan.table().startswith(f"memory budget {format_bytes(budget[0])}, {format_bytes(budget[1])} on ranks 0 to 1;")


def _selective_table(select_replay: float) -> Costs:
    # Each layer keeps 1000 B per sample, 400 of them (the cheap ops' outputs) when marked selectively.
    return Costs.from_table(8, [1e-3] * 8, [2e-3] * 8, [1000] * 8, [40] * 8, param_bytes=[100] * 8,
                            select_activation=[400] * 8, select_replay=[select_replay] * 8)


def test_selective_recompute_is_planned_where_it_frees_bytes_for_less_time() -> None:
    never = predict(_selective_table(1e-4), Candidate("1f1b", 8, (4, 4), "never"), runner="processes")
    budget = [never.peaks[0] - 600 * 2, never.peaks[1]]  # what two selective marks of one micro-batch free
    options = dict(runner="processes", schedules=["1f1b"], balances=[(4, 4)])
    # Selective replay a tenth of the forward: 600 B for 0.1 ms beats 960 B for 1 ms.
    cheap = search(_selective_table(1e-4), 2, budget, **options).candidate
    assert not any(cheap.recompute) and cheap.selective() and cheap.select[1] == 0, cheap.describe()
    assert cheap.select_names == DEFAULT_SELECT and "select=" in cheap.describe()
    assert cheap.distributed_kwargs()["recompute"] == {
        "recompute_config": {"select_recompute": {DEFAULT_SELECT[0]: list(cheap.select)}}}
    # Selective replay as long as the forward: full recompute frees more per second.
    dear = search(_selective_table(1e-3), 2, budget, **options).candidate
    assert any(dear.recompute) and not dear.selective(), dear.describe()
    # A budget only full marks reach: selective first where it pays, then raised to full.
    tight = [never.peaks[0] - 4000, never.peaks[1]]  # more than every selective mark frees (3504 B)
    both = search(_selective_table(1e-4), 2, tight, **options)
    assert any(both.candidate.recompute) and all(p <= b for p, b in zip(both.best.peaks, tight))
    # Tabled costs without selective numbers never plan it; half of them is refused.
    assert not search(table([1e-3] * 8), 2, budget, **options).candidate.selective()
    with pytest.raises(ValueError, match="select_activation and select_replay together"):
        Costs.from_table(8, [1e-3], [2e-3], [1000], [40], select_replay=[1e-4])


def test_the_search_simulates_only_candidates_that_can_win() -> None:
    costs = Costs.from_table(64, [1e-5] * 100, [2e-5] * 100, [4096] * 100, [1024] * 100, param_bytes=[10**6] * 100)
    plan = search(costs, 4, "1GiB", runner="processes", max_balances=8)
    assert plan.simulated < plan.considered / 2, (plan.simulated, plan.considered)
    every = min(predict(costs, c, runner="processes", timeline=False).step_time
                for c in candidates(costs, 4, "processes", max_balances=8))
    assert plan.best.step_time == pytest.approx(every)  # the bound never prunes the winner


def test_zero_bubble_schedules_are_planned_for_processes() -> None:
    costs = table([1e-3] * 4)
    kinds = {c.schedule for c in candidates(costs, 2, "processes")}
    assert {"zb-h1", "zbv"} <= kinds
    zb = predict(costs, Candidate("zb-h1", 8, (2, 2), "never"), runner="processes")
    one = predict(costs, Candidate("1f1b", 8, (2, 2), "never"), runner="processes")
    assert zb.step_time < one.step_time  # W fills the bubble


def _uneven(seed: int) -> Costs:
    """4 layers of uneven costs whose backward splits unevenly into I and W (a W up to 4 times an I)."""
    rng = random.Random(seed)
    forward = [rng.uniform(0.5e-3, 2e-3) for _ in range(4)]
    costs = Costs.from_table(8, forward, [2 * f for f in forward], [1000] * 4, [4000] * 4, param_bytes=[100] * 4)
    share = rng.uniform(0.2, 0.5)
    for rows, times in costs.backward.items():
        costs.input_grad[rows] = [share * t for t in times]
        costs.weight_grad[rows] = [(1 - share) * t for t in times]
    return costs


LINK = TimeModel(link=Link(2e-4, 1e-8), action_overhead=1e-4)
FIXED = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


@pytest.mark.parametrize("seed", range(6))
def test_orders_built_from_the_costs_are_planned_on_request_and_never_slower(seed: int) -> None:
    """schedules=[..., "auto", "auto-v"]: each candidate's order built from its own stage costs joins the fixed
    schedules; the plan is never slower in simulation, and the order it runs is the one it timed."""
    costs = _uneven(seed)
    fixed = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED)
    chosen = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED + ["auto", "auto-v"])
    assert chosen.best.step_time <= fixed.best.step_time
    if chosen.candidate.schedule in ("auto", "auto-v"):
        assert chosen.best.step_time < fixed.best.step_time  # at a tie the fixed schedule is kept
        table = chosen.distributed_kwargs()["schedule"]
        assert isinstance(table, TableSchedule) and table is chosen.best.schedule
        assert (table.ranks, table.microbatches, table.stages) == (2, chosen.candidate.chunks,
                                                                   len(chosen.candidate.balance))
        table.validate()
        again = predict(costs, chosen.candidate, runner="processes", model=LINK)
        assert again.step_time == chosen.best.step_time and again.schedule == table  # one order per plan
        v = chosen.candidate.schedule == "auto-v"
        assert [table.rank_of(s) for s in range(table.stages)] == ([0, 1, 1, 0] if v else [
            s % 2 for s in range(table.stages)])


def test_by_default_an_order_is_built_only_where_it_may_win() -> None:
    """search's default for processes: the fixed schedules and the orders built from the costs, an order built
    only for a cut whose bound is below the fastest plan found; never slower than the fixed schedules or than
    the built orders alone (auto_schedule's search), with fewer orders built than for every cut."""
    gains, default_built, every_built = [], 0, 0
    for seed in range(12):
        costs = _uneven(seed)
        fixed = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED)
        assert not costs._orders
        default = search(costs, 2, "1GiB", runner="processes", model=LINK)
        default_built += len(costs._orders)
        costs._orders.clear()
        every = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED + ["auto", "auto-v"])
        every_built += len(costs._orders)
        alone = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=["auto", "auto-v"], runners_up=0,
                       per_stage=False)
        assert default.best.step_time <= min(fixed.best.step_time, alone.best.step_time) * (1 + 1e-9)
        assert default.best.step_time == pytest.approx(every.best.step_time, rel=1e-9)
        if default.candidate.schedule in ("auto", "auto-v"):
            assert default.best.step_time < fixed.best.step_time  # at a tie the fixed schedule is kept
            assert default.distributed_kwargs()["schedule"] is default.best.schedule
        gains.append(1 - default.best.step_time / fixed.best.step_time)
    assert max(gains) > 0.01, gains
    assert 0 < default_built < every_built, (default_built, every_built)


def test_plans_with_recompute_marks_or_offload_get_no_built_order() -> None:
    """A built order may split a backward into I and W, where a marked layer would replay twice (the profile
    cannot count it): per-stage recompute and offload are planned on the fixed schedules only, as on
    zero-bubble ones."""
    costs = table([1e-3] * 4)  # recompute lowers the peak: activations 1000 bytes, outputs 40
    for kind, virtual in (("1f1b", 1), ("auto", 1), ("auto", 2), ("auto-v", 2)):
        balance = (1, 1, 1, 1) if virtual == 2 else (2, 2)
        plan = Candidate(kind, 4, balance, "never", virtual)
        tight = predict_memory(costs, replace(plan, checkpoint="always"), runner="processes")[0]  # fits all marked
        marked = per_stage_recompute(costs, plan, tight, "processes")
        if kind in ("auto", "auto-v"):
            assert marked is None and per_stage_offload(costs, plan, tight, "processes") is None
        else:
            assert marked is not None and any(marked.recompute), kind


def test_some_order_built_from_the_costs_beats_every_fixed_schedule() -> None:
    gains = []
    for seed in range(12):
        costs = _uneven(seed)
        fixed = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED).best.step_time
        auto = search(costs, 2, "1GiB", runner="processes", model=LINK, schedules=FIXED + ["auto", "auto-v"])
        gains.append(1 - auto.best.step_time / fixed)
    assert max(gains) > 0.01 and min(gains) >= 0, gains


def test_orders_built_from_the_costs_are_refused_where_they_cannot_run() -> None:
    costs = table([1e-3] * 4)
    with pytest.raises(ValueError, match=r"schedules \['auto'\] cannot run with runner='threads'"):
        search(costs, 2, "1GiB", schedules=["auto"])
    with pytest.raises(ValueError, match="offload=.* is not planned with the order built from the costs 'auto'"):
        predict(costs, Candidate("auto", 2, (2, 2), "never", offload=(1, 0)), runner="processes")
    with pytest.raises(ValueError, match="'auto-v' is planned with two stages per rank, got virtual_stages=1"):
        predict(costs, Candidate("auto-v", 2, (2, 2), "never"), runner="processes")
