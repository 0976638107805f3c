"""``pipe.plan.planned_pipe`` and ``pipe.plan.planned_distributed``: planned, fitting, same gradients; the front ends
refuse ``memory_budget=`` and name them."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import mlp
from pipe.plan import PlanError, planned_distributed, planned_pipe
from pipe.distributed import make_mesh
from pipe.plan.measure import measure_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from spawn_ranks import run_ranks  # noqa: E402

WIDTH = 32
BUDGET = 200_000  # bytes per rank: between the all-checkpointed and the never-checkpointed peaks below


def test_pipe_applies_the_plan_and_keeps_the_gradients() -> None:
    model, reference = mlp(), mlp()
    x = torch.randn(16, WIDTH)
    piped = planned_pipe(model, x, memory_budget="64MiB", devices=["cpu", "cpu"])
    assert piped.plan is not None
    assert (piped.chunks, piped.balance, piped.checkpoint) == (
        piped.plan.candidate.chunks, list(piped.plan.candidate.balance), piped.plan.candidate.checkpoint)
    piped(x).square().mean().backward()
    reference(x).square().mean().backward()
    piped.close()
    for a, b in zip(piped.parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_pipe_memory_budget_needs_a_sample_and_devices_and_no_balance() -> None:
    x = torch.randn(16, WIDTH)
    with pytest.raises(ValueError, match="needs sample, one mini-batch"):
        planned_pipe(mlp(), None, memory_budget="1GiB", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="needs devices="):
        planned_pipe(mlp(), x, memory_budget="1GiB", devices=[])
    with pytest.raises(ValueError, match="chooses the balance"):
        planned_pipe(mlp(), x, memory_budget="1GiB", balance=[2, 2], devices=["cpu", "cpu"])
    # The plan's peaks hold for its own recompute marks: a config of the user's would silently replace them.
    with pytest.raises(ValueError, match=r"pipe\.plan\.planned_pipe\(\) chooses what each stage "
                                         r"recomputes, and its predicted peaks hold for that alone; leave recompute= out"):
        planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"],
                     recompute={"recompute_config": {"recompute": [1, 1]}})


def test_pipe_memory_budget_keeps_the_chunks_and_checkpoint_given() -> None:
    """A chunks or checkpoint other than the default narrows the plan to it; a budget none of those plans
    fits says so, and names what narrowed it."""
    x = torch.randn(16, WIDTH)
    free = planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"])
    assert (free.chunks, free.checkpoint) != (4, "always")  # what the plan chooses when free
    free.close()
    model = planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    assert (model.chunks, model.checkpoint) == (4, "always")
    assert (model.plan.candidate.chunks, model.plan.candidate.checkpoint) == (4, "always")
    model.close()
    with pytest.raises(PlanError, match=r"\(among the plans with chunks=4, checkpoint='always', as given to pipe\.plan\.planned_pipe: "
                                        r"leave them out to let the plan choose them\)"):
        planned_pipe(mlp(), x, memory_budget=1000, devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    with pytest.raises(ValueError, match="checkpoint"):
        planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"], checkpoint="sometimes")


def test_pipe_memory_budget_times_layers_with_the_partitions_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan times layers with the intra-op threads each CPU partition's worker will compute with
    (cpu_threads, by default this process's divided among the CPU partitions), not all of this process's."""
    import pipe.plan.apply as apply

    seen: list[Any] = []
    search = apply.plan
    monkeypatch.setattr(apply, "plan", lambda *args, **kwargs: seen.append(kwargs.get("threads")) or search(*args, **kwargs))
    real = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # as on a 4-core machine
    x = torch.randn(16, WIDTH)
    try:
        planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"], cpu_threads=1).close()
        with warnings.catch_warnings():  # 2 partitions x 2 threads compete on a machine of fewer than 4 cores
            warnings.simplefilter("ignore", UserWarning)
            planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"]).close()
    finally:
        torch.set_num_threads(real)  # the profile restores the thread count it read, which was patched
    assert seen == [1, 2]


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                    reason="compile= needs torch >= 2.13")  # refused there (pipe.compile.verify_compile says why)
def test_pipe_memory_budget_warns_that_compiled_layers_were_planned_eager() -> None:
    x = torch.randn(16, WIDTH)
    with pytest.warns(UserWarning, match=r"pipe\.plan\.planned_pipe\(\.\.\., compile=\.\.\.\) plans the layers as "
                                         r"they run eager: the plan's predicted peaks and step times are eager"):
        model = planned_pipe(mlp(), x, memory_budget="1GiB", devices=["cpu", "cpu"], compile={"backend": "eager"})
    model.close()


def _planned_rank(rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    from pipe.core.schedule import Schedule

    try:
        planned_distributed(mlp(), x, memory_budget=BUDGET, target=y, loss_fn=nn.functional.mse_loss,
                            recompute={"recompute_config": {"recompute": [1, 1]}})
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    try:
        planned_distributed(mlp(), x, memory_budget=BUDGET, target=y, loss_fn=nn.functional.mse_loss,
                            parallelize=lambda stage, mesh: None)
        parallelized = "no error"
    except ValueError as error:
        parallelized = str(error)
    refusals = []
    for options in ({"schedule": Schedule("1f1b", ranks=2, microbatches=2)},
                    {"schedule": "interleaved", "virtual_stages": 3}):
        try:
            planned_distributed(mlp(), x, memory_budget=BUDGET, target=y, loss_fn=nn.functional.mse_loss, **options)
            refusals.append("no error")
        except ValueError as error:
            refusals.append(str(error))
    import pipe.plan.apply as apply

    model = planned_distributed(mlp(), x, memory_budget=BUDGET, target=y, loss_fn=nn.functional.mse_loss)
    static = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    measured = measure_step(model, x, y, nn.functional.mse_loss, repeat=1)
    reference = mlp()
    nn.functional.mse_loss(reference(x), y).backward()
    mine = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        if name in mine:  # two steps since the gradients were zeroed
            assert torch.allclose(mine[name].grad, 2 * param.grad, atol=1e-5), name
    # A schedule and chunks given are kept: ones the free plan did not choose (its choice is by measured times,
    # so which it is depends on the machine's load; both of these fit the budget).
    given = ("zb-h1", 2) if (model.schedule.kind, model.chunks) != ("zb-h1", 2) else ("1f1b", 4)
    profiled_on: list[str] = []  # rank 0 profiles on the ranks' device (the GPU under NCCL), not always the CPU
    search = apply.plan
    apply.plan = lambda *args, **kwargs: profiled_on.append(str(kwargs.get("device"))) or search(*args, **kwargs)
    try:
        kept = planned_distributed(mlp(), x, memory_budget=BUDGET, target=y, loss_fn=nn.functional.mse_loss,
                                   schedule=given[0], chunks=given[1], device=torch.device("cpu"))
    finally:
        apply.plan = search
    # schedule="auto": the order built from the plan's own stage costs, as a table every rank runs.
    auto = planned_distributed(mlp(), x, memory_budget="1GiB", target=y, loss_fn=nn.functional.mse_loss,
                               schedule="auto")
    auto.step(x, y)
    reference = mlp()
    nn.functional.mse_loss(reference(x), y).backward()
    mine = dict(auto.named_parameters())
    exact = all(torch.allclose(mine[name].grad, param.grad, atol=1e-6) for name, param in reference.named_parameters()
                if name in mine)
    return {"peak": static + measured.activation_peak, "refused": refused, "parallelized": parallelized,
            "refusals": refusals, "given": given, "kept": (kept.schedule.kind, kept.chunks), "profiled_on": profiled_on,
            "plan": (model.chunks, model.balance, model.checkpoint, model.schedule.kind),
            "auto": (auto.schedule.kind, auto.schedule.programs, exact and bool(mine))}


def test_distributed_pipe_plans_on_rank_0_and_fits_the_budget() -> None:
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    results = run_ranks(_planned_rank, 2, x, y, deadline=120)
    assert all("pipe.plan.planned_distributed() chooses what each stage recomputes" in r["refused"]
               for r in results), results[0]["refused"]
    assert all("plans the stages as the model builds them, but parallelize='<lambda>' changes them after the "
               "plan" in r["parallelized"] for r in results), results[0]["parallelized"]
    table, virtual = results[0]["refusals"]
    assert "plans the built-in schedules, not a schedule given as a table (Schedule)" in table, table
    assert "plans 2 virtual stages per rank for \"interleaved\" and \"zbv\" and 1 otherwise, got virtual_stages=3" \
        in virtual, virtual
    # A schedule and chunks given are kept (given other than the free plan's: kept, not chosen anyway).
    assert all(r["kept"] == results[0]["given"] for r in results), results
    assert [r["profiled_on"] for r in results] == [["cpu"], []], results  # rank 0 alone plans, on the device
    assert results[0]["plan"] == results[1]["plan"]
    assert all(r["peak"] <= BUDGET for r in results), results
    assert all(r["auto"][0] == "table" and r["auto"][2] for r in results), [r["auto"] for r in results]
    assert results[0]["auto"][1] == results[1]["auto"][1]  # rank 0's order, on every rank


def _replicated_rank(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, tight: int,
                     budget: int) -> dict[str, Any]:
    # Two replicas of a 2-rank pipeline, each on its half of the batch: the averager's flat copies of the
    # gradients are part of every rank's peak, and the plan must count them.
    half = x.size(0) // 2
    mesh = make_mesh(pp=world // 2, dp_replicate=2)
    try:
        planned_distributed(mlp(), x[:half], mesh=mesh, memory_budget=tight, target=y[:half],
                        loss_fn=nn.functional.mse_loss)
        refused = "planned"
    except ValueError as error:
        refused = str(error)
    model = planned_distributed(mlp(), x[:half], mesh=mesh, memory_budget=budget, target=y[:half],
                            loss_fn=nn.functional.mse_loss)
    rows = slice(half * model.topology.replica, half * (model.topology.replica + 1))
    static = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    measured = measure_step(model, x[rows], y[rows], nn.functional.mse_loss, repeat=1)
    return {"peak": static + measured.activation_peak, "refused": refused,
            "plan": (model.chunks, model.balance, model.checkpoint, model.schedule.kind)}


def test_distributed_pipe_with_replicas_plans_their_gradient_copies_and_fits() -> None:
    from pipe.plan import Candidate, predict, profile_costs
    from pipe.plan.sharding import replica_costs

    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    # Small activations, heavy parameters: each rank ends its step holding its parameters, gradients and the
    # averager's copy of the gradients. Below that nothing fits (a plan without the copies would fit, and
    # run over); 1% above the smallest predicted peak, the chosen plan fits when run.
    costs = profile_costs(mlp(), x, (2, 4, 8, 16), loss_fn=nn.functional.mse_loss, target=y)
    plans = [predict(costs, Candidate("1f1b", c, (2, 2), mode, dp_replicate=2), runner="processes")
             for c in (1, 2, 4, 8) for mode in ("never", "always")]
    copies = sum(costs.param_bytes[:2])
    tight = int((plans[0].static[0] + copies) * 0.99)
    alone = replica_costs(costs, 2)  # one pipeline's half of the batch, no replicas
    assert min(predict(alone, Candidate("1f1b", c, (2, 2), "never"), runner="processes").peak for c in (1, 2, 4)) < tight
    budget = int(min(p.peak for p in plans) * 1.01)
    results = run_ranks(_replicated_rank, 4, x, y, tight, budget, deadline=180)
    assert all("no plan fits memory_budget" in r["refused"] for r in results), results[0]["refused"]
    assert all(r["plan"] == results[0]["plan"] for r in results), results
    assert all(r["peak"] <= budget for r in results), (budget, results)


def test_distributed_plans_what_the_shard_leaves_open_and_refuses_what_it_cannot_count() -> None:
    from pipe.distributed import Shard
    from pipe.plan.apply import _planned_units

    every = (("stage", "block"), ("step", "micro-batch"))
    assert _planned_units(None, explicit=False) == every  # the mesh's default Shard(): all the planner counts
    assert _planned_units(Shard(), explicit=True) == every
    assert _planned_units(Shard(unit="stage"), explicit=True) == (("stage",), every[1])
    assert _planned_units(Shard(unit="block"), explicit=True) == (("block",), ("step",))
    assert _planned_units(Shard(reduce="micro-batch"), explicit=True) == (("block",), ("micro-batch",))
    assert _planned_units(Shard(blocks=lambda name, module: False), explicit=True) == (("stage",), ("step",))
    for shard, message in ((Shard(prefetch=False), r"but shard=Shard\(prefetch=False\) does otherwise"),
                           (Shard(reshard_after_backward=False), r"shard=Shard\(reshard_after_backward=False\)"),
                           (Shard(unit="block", blocks=lambda name, module: False), "chooses its own; leave blocks=")):
        with pytest.raises(ValueError, match=message):
            _planned_units(shard, explicit=True)
