"""Planning N ranks as pp x dp_replicate x dp_shard: the candidates, their memory against a measured 4-rank run,
the choice."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import mlp
from pipe.plan import Candidate, Costs, TimeModel, predict, profile_costs, search
from pipe.plan.predict import LOSS_SCALAR_BYTES, predict_memory
from pipe.plan.measure import measure_step
from pipe.plan.sharding import replica_costs, split_candidates
from pipe.plan.timing import Link

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from spawn_ranks import run_ranks  # noqa: E402

WIDTH = 32


def table(batch: int = 4, params: int = 10_000, chunks: tuple[int, ...] = (1, 2, 4, 8)) -> Costs:
    """4 equal layers: 1 ms forward, 2 ms backward per sample; heavy parameters, light activations."""
    return Costs.from_table(batch, [1e-3] * 4, [2e-3] * 4, [1000] * 4, [40] * 4, param_bytes=[params] * 4,
                            chunks=chunks)


def test_candidates_cover_every_divisor_split_in_both_zero_modes() -> None:
    found, skipped = split_candidates(table(batch=8), 4, "processes", "auto", (3, 2))
    assert not skipped
    splits = {(c.ranks, c.dp_shard, c.reshard_after_forward) for c in found}
    assert splits == {(4, 1, True), (2, 2, True), (2, 2, False), (1, 4, True), (1, 4, False)}
    # One stage per rank: ZeRO-2 is ZeRO-3's plan, kept once; two stages per rank (interleaved, zbv): both.
    assert all(c.virtual_stages == 2 for c in found if c.dp_shard > 1 and not c.reshard_after_forward)
    # dp_shard S runs chunks c on B / (S c) rows: the profile of chunks S c (8 samples, chunks up to 8).
    assert {c.chunks for c in found if c.dp_shard == 4} == {1, 2}
    assert {c.chunks for c in found if c.dp_shard == 1} == {1, 2, 4, 8}
    assert replica_costs(table(batch=8), 4).stage_costs([(0, 1)], 2) == table(batch=8).stage_costs([(0, 1)], 8)


def test_a_layer_at_a_time_is_planned_under_zero3_where_the_backward_is_whole() -> None:
    costs = table(batch=8)
    found, _ = split_candidates(costs, 4, "processes", [2], (3, 2))
    layered = [c for c in found if c.unit == "block"]
    assert {c.reduce for c in layered} == {"step", "micro-batch"} and all(c.reshard_after_forward for c in layered)
    assert {c.schedule for c in layered} == {"gpipe", "1f1b", "interleaved"}  # not zb-h1, zbv: their W is apart
    assert {c.schedule for c in found if c.unit == "stage"} >= {"zb-h1", "zbv"}
    assert all(c.distributed_kwargs()["shard"].unit == c.unit and c.distributed_kwargs()["shard"].reduce == c.reduce
               for c in found)
    narrowed, _ = split_candidates(costs, 4, "processes", [2], (3,), units=("block",), reduces=("micro-batch",))
    assert {(c.unit, c.reduce) for c in narrowed} == {("block", "micro-batch")}
    # HSDP too, reducing after each backward with each layer's all-reduced shard counted (the measured run below).
    hsdp, _ = split_candidates(costs, 4, "processes", [2], (3,), [2])
    assert {(c.unit, c.reduce) for c in hsdp} == {("stage", "step"), ("block", "step"), ("block", "micro-batch")}
    with pytest.raises(ValueError, match=r"units=\['layer'\], reduces=\['step'\]: choose units among "
                                         r"\['stage', 'block'\] and reduces among \['step', 'micro-batch'\]"):
        split_candidates(costs, 4, "processes", [2], (3,), units=("layer",), reduces=("step",))
    # FSDP cannot shard a tied weight in two layers of one stage: no such plan a layer at a time.
    x = torch.randn(8, WIDTH)
    tied = profile_costs(tied_mlp(), x, (1, 2, 4), loss_fn=nn.functional.mse_loss, target=x)
    plans, _ = split_candidates(tied, 2, "processes", [2], (3,))
    assert plans and not any(c.unit == "block" for c in plans)
    # Memory, 4 layers of 10 000 bytes on one stage, one micro-batch: a layer at a time holds two of them gathered
    # (one computing, the next one's gather), not four; reducing after each backward, two layers' gradients (one
    # and its copy for the reduce-scatter), not the stage's four.
    peak = {(u, r): predict_memory(costs, Candidate("gpipe", 1, (4,), "never", dp_shard=2, unit=u, reduce=r),
                                   runner="processes")[0][0] for u, r in (("stage", "step"), ("block", "step"),
                                                                          ("block", "micro-batch"))}
    assert peak["stage", "step"] - peak["block", "step"] == 20_000
    assert peak["block", "step"] - peak["block", "micro-batch"] == 20_000


def test_a_tight_budget_pipelines_and_a_loose_one_shards() -> None:
    costs = table()
    # Loose: no bubble on pp1 x dp_shard4 (12 ms of compute per rank) beats pp4's bubbles (collectives free here).
    loose = search(costs, 4, "1GiB", runner="processes", dp_shard="auto")
    assert (loose.candidate.ranks, loose.candidate.dp_shard) == (1, 4)
    assert loose.best.step_time == pytest.approx(12e-3)
    assert loose.mesh_kwargs() == {"pp": 1, "dp_shard": 4}
    assert loose.distributed_kwargs()["shard"].reshard_after_forward is loose.candidate.reshard_after_forward
    # Tight: a sharded rank holds its whole stage's parameters and gradients unsharded during the step,
    # so the most pipeline ranks need the least; the table says why the splits lost.
    pipelined = min(predict(costs, c, runner="processes").peak
                    for c in split_candidates(costs, 4, "processes", [1], (3,))[0])
    tight = search(costs, 4, pipelined, runner="processes", dp_shard="auto")
    assert (tight.candidate.ranks, tight.candidate.dp_shard) == (4, 1)
    text = tight.table()
    assert "splits of the ranks (pp x dp_shard):" in text
    assert re.search(r"pp4 x dp_shard1 +chosen", text)
    assert re.search(r"pp1 x dp_shard4 zero3 +over budget", text), text
    assert "pp4 x dp_shard1" in next(line for line in text.splitlines() if line.startswith("* "))  # its split
    sharded = [why for p, why in tight.rejected if p.candidate.dp_shard == 4]
    assert sharded and all("faster, but pipeline rank 0 (stage 0: layers 0-" in why for why in sharded), sharded
    assert tight.mesh_kwargs() == {"pp": 4, "dp_shard": 1} and "shard" not in tight.distributed_kwargs()


def test_bad_splits_raise_with_the_value_and_the_fix() -> None:
    costs = table(batch=8, chunks=(1, 2))
    with pytest.raises(ValueError, match=r"dp_shard=\[3\] does not divide the 4 ranks .* among \[1, 2, 4\]"):
        search(costs, 4, "1GiB", runner="processes", dp_shard=[3])
    with pytest.raises(ValueError, match=r"dp_shard=4 runs micro-batches of 2 / chunks samples, but the profile "
                                         r"has none of them \(profiled chunk counts \[1, 2\]\); profile with chunks "
                                         r"that include \[4, 8\]"):
        search(costs, 4, "1GiB", runner="processes", dp_shard=[4])
    with pytest.raises(ValueError, match="only DistributedPipe runs; pass runner='processes'"):
        search(costs, 4, "1GiB", dp_shard="auto")
    with pytest.raises(ValueError, match="zero=\\[1\\]: choose ZeRO stages among \\[2, 3\\]"):
        search(costs, 4, "1GiB", runner="processes", dp_shard="auto", zero=(1,))
    with pytest.raises(ValueError, match="give one size for every rank"):
        search(costs, 4, ["1GiB", "2GiB", "1GiB", "1GiB"], runner="processes", dp_shard="auto")
    with pytest.raises(ValueError, match="does not divide the mini-batch of 8 samples"):
        replica_costs(costs, 3)
    # "auto" leaves out the splits whose micro-batches were not profiled, and says so.
    plan = search(costs, 4, "1GiB", runner="processes", dp_shard="auto")
    assert any(line.startswith("left out: pp1 x dp_shard4: dp_shard=4 runs micro-batches") for line in plan.splits)


def test_replicas_join_the_splits_hold_their_gradient_copies_and_pay_their_all_reduce() -> None:
    costs = table(batch=8)
    found, skipped = split_candidates(costs, 4, "processes", "auto", (3,), "auto")
    assert not skipped
    assert {(c.ranks, c.dp_replicate, c.dp_shard) for c in found} == {
        (4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)}
    # dp_replicate R x dp_shard S splits the batch R S ways: chunks c is the profile of chunks R S c.
    assert {c.chunks for c in found if c.dp_replicate * c.dp_shard == 4} == {1, 2}
    replicated = Candidate("gpipe", 1, (4,), "never", dp_replicate=4)
    assert replicated.world == 4 and replicated.mesh_kwargs() == {"pp": 1, "dp_shard": 1, "dp_replicate": 4}
    assert "shard" not in replicated.distributed_kwargs()
    # Memory: the full static bytes, and after the last backward a flat copy of every gradient (the averager's),
    # beside the step's running loss (the last cell's loss went with its backward).
    peaks, static = predict_memory(costs, replicated, runner="processes")
    assert static == [80_000] and peaks == [80_000 + 40_000 + LOSS_SCALAR_BYTES // 2]
    # Time: one all-reduce of the stage's gradients over the 4 replicas, on the last backward.
    link = Link(1e-4, 1e-9, reduce_latency=2e-4, reduce_per_byte=3e-9, collective_overhead=1e-3)
    model = TimeModel(link=link)
    alone = predict(replica_costs(costs, 4), Candidate("gpipe", 1, (4,), "never"), runner="processes", model=model)
    step = predict(costs, replicated, runner="processes", model=model).step_time
    assert step == pytest.approx(alone.step_time + 6 * 1e-4 + 6 / 4 * 40_000 * 3e-9)
    # HSDP: sharded over 2, the shard all-reduced over 2 more: the memory of dp_shard 2 on B / 4 samples.
    hsdp = Candidate("gpipe", 1, (4,), "never", dp_shard=2, dp_replicate=2)
    assert predict_memory(costs, hsdp, runner="processes") == predict_memory(
        replica_costs(costs, 2), Candidate("gpipe", 1, (4,), "never", dp_shard=2), runner="processes")
    # The choice: loose, replicas (no bubble, the cheapest collective); tighter, their copies do not fit.
    loose = search(costs, 4, "1GiB", runner="processes", dp_shard="auto", dp_replicate="auto", model=model)
    assert (loose.candidate.ranks, loose.candidate.dp_replicate, loose.candidate.dp_shard) == (1, 4, 1)
    assert loose.mesh_kwargs() == {"pp": 1, "dp_shard": 1, "dp_replicate": 4}
    text = loose.table()
    assert "splits of the ranks (pp x dp_replicate x dp_shard):" in text
    assert re.search(r"pp1 x dp_replicate4 +chosen", text) and re.search(r"pp1 x dp_replicate2 x dp_shard2 zero3 +slower", text)
    tight = search(costs, 4, 100_000, runner="processes", dp_replicate="auto", model=model)
    assert tight.candidate.dp_replicate < 4 and tight.candidate.dp_shard == 1
    assert "splits of the ranks (pp x dp_replicate):" in tight.table()
    assert re.search(r"pp1 x dp_replicate4 +over budget", tight.table())
    with pytest.raises(ValueError, match=r"dp_replicate=\[3\] does not divide the 4 ranks into pp x dp_replicate"):
        search(costs, 4, "1GiB", runner="processes", dp_replicate=[3])
    with pytest.raises(ValueError, match=r"dp_replicate=\[4\] x dp_shard=\[4\]: no pair of sizes divides the 4 "):
        search(costs, 4, "1GiB", runner="processes", dp_replicate=[4], dp_shard=[4])
    with pytest.raises(ValueError, match="dp_replicate='auto' plans data-parallel replicas, which only "
                                         "DistributedPipe runs"):
        search(costs, 4, "1GiB", dp_replicate="auto")


# pp, dp_shard, schedule, chunks, checkpoint, ZeRO-3 (ZeRO-2 differs where a rank holds two stages: interleaved,
# zbv), dp_replicate: one 4-rank launch measures them all.
CONFIGS = [(2, 2, "gpipe", 2, "never", True, 1), (2, 2, "1f1b", 4, "never", True, 1),
           (2, 2, "gpipe", 2, "always", True, 1), (2, 2, "interleaved", 2, "never", True, 1),
           (2, 2, "interleaved", 2, "never", False, 1), (2, 2, "zb-h1", 2, "never", True, 1),
           (2, 2, "zbv", 2, "never", True, 1), (2, 2, "zbv", 2, "except_last", False, 1),
           (1, 4, "gpipe", 2, "never", True, 1), (4, 1, "gpipe", 4, "never", True, 1),
           # Replicas: the averager's flat copies of each stage's gradients, from its last backward to the
           # step's end (pp2 x dp_replicate2, interleaved: the first stage's copies while the other's backward
           # runs); pp1 x dp_replicate4; HSDP (pp1 x dp_replicate2 x dp_shard2) holds what dp_shard2 does.
           (2, 1, "1f1b", 2, "never", True, 2), (2, 1, "interleaved", 2, "never", True, 2),
           (2, 1, "zbv", 2, "never", True, 2), (1, 1, "gpipe", 1, "never", True, 4),
           (1, 2, "gpipe", 2, "never", True, 2), (1, 2, "gpipe", 1, "always", False, 2)]


def _candidate(pp: int, shard: int, schedule: str, chunks: int, checkpoint: str, zero3: bool,
               replicate: int = 1, reduce: str = "", layers: int = 4) -> Candidate:
    """``reduce``: FSDP gathers a layer at a time (``unit="block"``), reducing with it; "": a stage whole."""
    virtual = 2 if schedule in ("interleaved", "zbv") else 1
    return Candidate(schedule, chunks, (layers // (pp * virtual),) * (pp * virtual), checkpoint, virtual,
                     dp_shard=shard, reshard_after_forward=zero3, dp_replicate=replicate,
                     unit="block" if reduce else "stage", reduce=reduce or "step")


# FSDP gathering a layer at a time (unit="block"), reducing once a step or after each backward, on 8 layers (so
# that a stage of 4 holds fewer gathered than whole): pp, dp_shard, schedule, chunks, checkpoint, reduce,
# dp_replicate. (Left out: pp1 x dp_shard4 reducing once a step, where one rank of four holds 16 KB more in many
# runs, see below.) HSDP (pp1 x dp_replicate2 x dp_shard2) reducing after each backward keeps each layer's
# all-reduced shard until its next reduce: in GPipe's second backward they add up layer by layer, in 1F1B's
# later ones all are held; interleaved, a stage's while the rank's other stage runs.
BLOCKS = [(2, 2, "gpipe", 2, "never", "step", 1), (2, 2, "1f1b", 4, "never", "step", 1),
          (2, 2, "gpipe", 2, "always", "step", 1), (2, 2, "interleaved", 2, "never", "step", 1),
          (2, 2, "gpipe", 2, "never", "micro-batch", 1), (2, 2, "1f1b", 4, "except_last", "micro-batch", 1),
          (1, 4, "gpipe", 2, "never", "micro-batch", 1), (1, 2, "gpipe", 2, "never", "micro-batch", 2),
          (1, 2, "1f1b", 4, "always", "micro-batch", 2), (1, 2, "interleaved", 2, "never", "micro-batch", 2)]


def _block_candidate(pp: int, shard: int, schedule: str, chunks: int, checkpoint: str, reduce: str,
                     replicate: int) -> Candidate:
    return _candidate(pp, shard, schedule, chunks, checkpoint, True, replicate, reduce=reduce, layers=8)


def _measure_splits(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, tight: int,
                    budget: int, by_layer: int) -> dict[str, Any]:
    import pipe.distributed as pd
    from pipe.plan import planned_distributed

    results = []
    for layers, candidate in [(4, _candidate(*config)) for config in CONFIGS] + [
            (8, _block_candidate(*config)) for config in BLOCKS]:
        model = pd.DistributedPipe(mlp(layers), mesh=pd.make_mesh(**candidate.mesh_kwargs()),
                                   **candidate.distributed_kwargs())
        share = x.size(0) // model.topology.data_parallel
        rows = slice(model.topology.replica * share, (model.topology.replica + 1) * share)
        measured = measure_step(model, x[rows], y[rows], nn.functional.mse_loss, repeat=1)
        results.append((model.topology.pipeline_rank, measured.activation_peak))
    # pipe.plan.planned_distributed on a sharding mesh plans the split it is given (ZeRO-2 here), each
    # pipeline with its sample: below what FSDP holds, nothing fits; above, the chosen plan fits when run.
    mesh, half = pd.make_mesh(pp=2, dp_shard=2), x.size(0) // 2
    options = dict(target=y[:half], loss_fn=nn.functional.mse_loss, mesh=mesh,
                   shard=pd.Shard(reshard_after_forward=False))
    try:
        planned_distributed(mlp(), x[:half], memory_budget=tight, **options)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    model = planned_distributed(mlp(), x[:half], memory_budget=budget, **options)
    rows = slice(half * model.topology.replica, half * (model.topology.replica + 1))
    planned = measure_step(model, x[rows], y[rows], nn.functional.mse_loss, repeat=1).activation_peak
    static = sum(2 * p.to_local().numel() * p.element_size() for p in model.parameters())  # shards, and gradients
    # ZeRO-3 on a budget only FSDP reducing each layer after each backward fits: the plan gathers a layer at a
    # time and reduces per micro-batch, and its run fits.
    zero3 = planned_distributed(mlp(8), x[:half], memory_budget=by_layer, target=y[:half],
                                loss_fn=nn.functional.mse_loss, mesh=mesh, chunks=2, schedule="gpipe")
    units = (zero3.shard.unit, zero3.shard.reduce, zero3.shard.reshard_after_forward)
    layered = measure_step(zero3, x[rows], y[rows], nn.functional.mse_loss, repeat=1).activation_peak + sum(
        2 * p.to_local().numel() * p.element_size() for p in zero3.parameters())
    try:
        planned_distributed(mlp(), x[:half], memory_budget="1GiB", mesh=mesh, shard=pd.Shard(prefetch=False))
        block = "no error"
    except ValueError as error:
        block = str(error)
    try:
        planned_distributed(mlp(), x, memory_budget="1GiB", mesh=pd.make_mesh(pp=1, dp_shard=2, tp=2))
        tp = "no error"
    except ValueError as error:
        tp = str(error)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    try:
        planned_distributed(mlp(), x, memory_budget="1GiB", mesh=pd.make_mesh(pp=2, dp_shard=2),
                           shard=pd.Shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
        mixed = "no error"
    except ValueError as error:
        mixed = str(error)
    return {"peaks": results, "refused": refused, "planned": (model.chunks, model.balance, model.schedule.kind),
            "planned_peak": planned + static, "tp": tp, "mixed": mixed, "units": units, "block": block,
            "layered": layered}


def test_predicted_peaks_of_sharded_plans_match_a_measured_run_on_4_ranks() -> None:
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    costs = profile_costs(mlp(), x, (1, 2, 4, 8, 16), loss_fn=nn.functional.mse_loss, target=y)
    # pipe.plan.planned_distributed on pp2 x dp_shard2 in ZeRO-2: 1% under the smallest predicted peak of its
    # candidates (the bytes FSDP holds gathered are most of it: without them, plans would fit) and 1% over.
    zero2 = split_candidates(costs, 4, "processes", [2], (2,))[0]
    smallest = min(max(predict_memory(costs, c, runner="processes")[0]) for c in zero2)
    tight, budget = int(smallest * 0.99), int(smallest * 1.01)
    # ZeRO-3 on 8 layers (GPipe, 2 micro-batches, to plan quickly): 2% over the smallest peak of the plans
    # reducing per micro-batch, below every other's.
    costs8 = profile_costs(mlp(8), x, (1, 2, 4, 8, 16), loss_fn=nn.functional.mse_loss, target=y)
    zero3 = split_candidates(costs8, 4, "processes", [2], (3,), schedules=["gpipe"])[0]
    zero3 = [c for c in zero3 if c.chunks == 2]

    def smallest_of(reduce: str) -> int:
        return min(max(predict_memory(costs8, c, runner="processes")[0]) for c in zero3 if c.blocks == reduce)

    by_layer = int(smallest_of("micro-batch") * 1.02)
    assert by_layer < min(smallest_of("step"), smallest_of(""))
    reports = run_ranks(_measure_splits, 4, x, y, tight, budget, by_layer, deadline=300, timeout=120)
    measured = [r["peaks"] for r in reports]
    assert all("no plan fits memory_budget" in r["refused"] for r in reports), reports[0]["refused"]
    assert all(r["planned"] == reports[0]["planned"] for r in reports), reports
    assert all(r["planned_peak"] <= budget for r in reports), (budget, reports)
    assert all("does not plan tensor parallelism, but the mesh splits each stage over tp=2" in r["tp"]
               for r in reports), reports[0]["tp"]
    assert all("plans in the parameters' own precision, but shard=Shard(mp_policy=...) has FSDP gather and "
               "compute in torch.bfloat16" in r["mixed"] for r in reports), reports[0]["mixed"]
    assert all(r["units"] == ("block", "micro-batch", True) for r in reports), [r["units"] for r in reports]
    assert all(r["layered"] <= by_layer for r in reports), (by_layer, [r["layered"] for r in reports])
    assert all("plans FSDP gathering a layer at a time with the next one prefetched and each freed after its "
               "backward, but shard=Shard(prefetch=False) does otherwise" in r["block"] for r in reports), \
        reports[0]["block"]
    wrong, checked = [], 0
    planned = [(costs, _candidate(*config)) for config in CONFIGS] + [
        (costs8, _block_candidate(*config)) for config in BLOCKS]
    for k, (config, (counted_costs, candidate)) in enumerate(zip(CONFIGS + BLOCKS, planned)):
        prediction = predict(counted_costs, candidate, runner="processes")
        for rank in range(4):
            pipeline_rank, counted = measured[rank][k]
            # The step's bytes above the static ones (sharded: param_scale x params / dp_shard), counted alike:
            # activations, buffers, and FSDP's unsharded parameters and gradients (resized storages included).
            predicted = prediction.peaks[pipeline_rank] - prediction.static[pipeline_rank]
            # Within 0.01% here. Zero bubble: I and W counted per stage (as for unsharded plans,
            # tests/plan/test_cost.py), and a stage's first W creates its gradients (counted fresh, as a first
            # B): ZB-H1 exact, ZB-V +0.3% on its middle rank (the V's turn's input counted twice).
            # A layer at a time (pipe.plan.block_gathers): exact in most runs, but on the CPU a gather's buffer
            # is freed on gloo's worker thread, which now and then lets it go only after the next gather's
            # buffer is allocated: up to a layer more (4-7% more seen, on 1f1b reducing once a step, and on
            # pp1 x dp_shard4, left out above).
            low, high = ((0.98, 1.02) if config[2].startswith("zb") else
                         (0.85, 1.01) if k >= len(CONFIGS) else (0.99, 1.01))
            checked += 1
            if not low * counted <= predicted <= high * counted:
                wrong.append((config, rank, predicted, counted))
    assert checked == 4 * (len(CONFIGS) + len(BLOCKS)) and not wrong, wrong


def tied_mlp() -> nn.Sequential:
    """4 layers, the first and the last sharing one weight (as a GPT-2's embedding and head)."""
    torch.manual_seed(0)
    first, last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(WIDTH, WIDTH), last)


def _held_parameters(rank: int, world: int, kind: str) -> int:
    import pipe.distributed as pd

    model = pd.DistributedPipe(tied_mlp(), chunks=2, schedule=kind, virtual_stages=2, balance=[1, 1, 1, 1])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_tied_weight_is_held_once_per_rank_and_never_sharded_for_two_stages() -> None:
    x = torch.randn(8, WIDTH)
    costs = profile_costs(tied_mlp(), x, (1, 2, 4), loss_fn=nn.functional.mse_loss, target=x)
    weight = WIDTH * WIDTH * 4
    assert costs.tied == [((0, 3), weight)] and costs.param_bytes[0] == costs.param_bytes[3] == weight + WIDTH * 4
    # ZB-V puts stages 0 and 3 on rank 0: it holds the tied weight once, as the runner does.
    held = run_ranks(_held_parameters, 2, "zbv", deadline=120)
    zbv = Candidate("zbv", 2, (1, 1, 1, 1), "never", 2)
    assert predict(costs, zbv, runner="processes").static == [2 * held[0], 2 * held[1]]
    assert held[0] == costs.param_bytes[0] + costs.param_bytes[3] - weight
    assert predict(costs, Candidate("gpipe", 2, (4,), "never"), runner="processes").static == [
        2 * (sum(costs.param_bytes) - weight)]
    # FSDP cannot shard one parameter for two stages of a rank (DistributedPipe refuses): no such candidate.
    # ZB-V's V puts the first and the last stage on rank 0, and one rank of 2 virtual stages holds both.
    sharded, _ = split_candidates(costs, 4, "processes", [2], (3, 2))
    assert not any(c.schedule == "zbv" or (c.virtual_stages == 2 and c.ranks == 1) for c in sharded)
    assert any(c.schedule == "interleaved" and c.ranks == 2 for c in sharded)  # stages 0 and 3 apart: kept
    replicated, _ = split_candidates(costs, 4, "processes", None, (3,), [2])
    assert any(c.schedule == "zbv" for c in replicated)  # unsharded, a rank may hold both


def test_fsdp_collectives_cost_the_link_and_fsdp_s_own_overheads_per_step_and_byte() -> None:
    costs = table(batch=8)  # 4 layers of 10 000 bytes
    link = Link(1e-4, 1e-9, collective_overhead=1e-3, collective_per_byte=2e-9, shard_step_overhead=5e-3)
    model = TimeModel(link=link)
    sharded = Candidate("gpipe", 1, (4,), "never", dp_shard=2)
    alone = predict(replica_costs(costs, 2), Candidate("gpipe", 1, (4,), "never"), runner="processes", model=model)
    # Each layer: gathered before the forward and reduce-scattered after the backward, 1 ring step of 5 000
    # bytes each on 2 ranks; the stage's reduction adds its overhead per step.
    per_step = 1e-4 + 5_000 * 1e-9 + 1e-3 + 5_000 * 2e-9
    assert predict(costs, sharded, runner="processes", model=model).step_time == pytest.approx(
        alone.step_time + 4 * 2 * per_step + 5e-3)
    # A layer at a time, 2 micro-batches: each layer gathered for each forward and each backward, reduced once a
    # step (20 ring steps) or after each backward (24); a stage whole: gathered once, reduced once (8).
    alone = predict(replica_costs(costs, 2), Candidate("gpipe", 2, (4,), "never"), runner="processes", model=model)
    for unit, reduce, steps in (("stage", "step", 8), ("block", "step", 20), ("block", "micro-batch", 24)):
        sharded = Candidate("gpipe", 2, (4,), "never", dp_shard=2, unit=unit, reduce=reduce)
        assert predict(costs, sharded, runner="processes", model=model).step_time == pytest.approx(
            alone.step_time + steps * per_step + 5e-3)
    # A checkpointed cell's backward gathers each layer once more, for its replay: 4 ring steps a micro-batch.
    replayed = Candidate("gpipe", 2, (4,), "always", dp_shard=2, unit="block")
    alone = predict(replica_costs(costs, 2), Candidate("gpipe", 2, (4,), "always"), runner="processes", model=model)
    assert predict(costs, replayed, runner="processes", model=model).step_time == pytest.approx(
        alone.step_time + 28 * per_step + 5e-3)
