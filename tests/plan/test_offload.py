"""Planning offload: what an offloading stage leaves on the device, what its copies cost, and plans that run."""
from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import mlp, tabled_times
from pipe import Pipe
from pipe.plan import Candidate, Costs, predict, profile_costs
from pipe.plan.candidates import per_stage_offload
from pipe.plan.host_copy import HostCopy
from pipe.plan.profile import measure_host_copy
from pipe.plan.search import search
from pipe.recompute import ActivationMemory, apply_recompute_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from transformer_lm import build_model  # noqa: E402

FAST = HostCopy(latency=5e-6, per_byte=1 / 20e9)  # a what-if on the CPU: a GPU's copy to pinned memory


def counted_peak(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> int:
    model(x)  # warm up, and the gradients exist before counting: they are static
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with ActivationMemory() as memory:
        F.mse_loss(model(x), target).backward()
    return memory.peak_bytes


def test_an_offloading_stage_is_counted_by_what_stays_on_the_device() -> None:
    # The CPU plays the device: host copies are not counted, copies back are. The profile's count of a
    # stage offloading k layers moves its peak by as much as the swap config moves the model's own.
    model, x, target = mlp(layers=6, width=64), torch.randn(64, 64), torch.randn(64, 64)
    costs = profile_costs(model, x, (1,), rounds=1, loss_fn=F.mse_loss, target=target)
    plain = counted_peak(copy.deepcopy(model), x, target)
    predicted_plain = predict(costs, Candidate("gpipe", 1, (6,), "never"))
    moved = []
    for k in (2, 4, 6):
        marked = copy.deepcopy(model)
        candidate = Candidate("gpipe", 1, (6,), "never", offload=(k,))
        costs.host_copy = FAST
        apply_recompute_config(marked, candidate.recompute_config(), stages=[6])
        counted = counted_peak(marked, x, target)
        predicted = predict(costs, candidate)
        assert predicted_plain.peak - predicted.peak == plain - counted
        moved.append(plain - counted)
    assert moved[0] > 0 and moved[1] > moved[0]  # what leaves grows with the layers offloaded...
    kept = costs.stage_memory(0, 6, 1, False, offloaded=6).kept
    assert kept < costs.stage_memory(0, 6, 1, False).kept / 4  # ...and little stays between forward and backward


def test_copies_beyond_what_the_stage_computes_meanwhile_lengthen_its_actions() -> None:
    # 4 layers of 1 ms forward, 2 ms backward and 1 MB kept per micro-batch; copies at 1 ms per MB.
    slow = HostCopy(latency=0.0, per_byte=1e-9)
    costs = Costs.from_table(1, [1e-3] * 4, [2e-3] * 4, [10**6] * 4, [10**5] * 4, chunks=(1,), host_copy=slow)
    for offloaded, forward, backward in ((0, 4e-3, 8e-3), (1, 4e-3, 8e-3), (3, 4e-3, 8e-3), (4, 5e-3, 8e-3)):
        t = costs.stage_costs([(0, 4)], 1, offloaded=[offloaded])  # out: first layer + copies; back: copies + its backward
        assert (t.forward[0], t.backward[0]) == pytest.approx((forward, backward))
    slower = HostCopy(latency=1e-4, per_byte=3e-9)  # 3 ms per layer each way, and 0.1 ms per copy
    costs = Costs.from_table(1, [1e-3] * 4, [2e-3] * 4, [10**6] * 4, [10**5] * 4, chunks=(1,), host_copy=slower)
    t = costs.stage_costs([(0, 4)], 1, offloaded=[2])
    assert (t.forward[0], t.backward[0]) == pytest.approx((1e-3 + 6.2e-3, 6.2e-3 + 2e-3))
    assert predict(costs, Candidate("gpipe", 1, (4,), "never", offload=(2,))).step_time == pytest.approx(15.4e-3)


def test_the_planner_offloads_where_the_budget_needs_it_and_the_pipe_runs_the_plan_exactly() -> None:
    model, x, target = mlp(layers=6, width=64), torch.randn(64, 64), torch.randn(64, 64)
    # The bytes counted, the times tabled: offload (its copies hidden behind the compute) against recompute
    # (a replay) is a choice by time, and measured times made it the machine's (one paused timing of a
    # plain run made a selective replay look free).
    costs = tabled_times(profile_costs(model, x, (1, 2, 4), rounds=1, loss_fn=F.mse_loss, target=target))
    never = predict(costs, Candidate("gpipe", 1, (6,), "never"))
    budget = int(never.static[0] + 0.6 * (never.peak - never.static[0]))
    assert per_stage_offload(costs, Candidate("gpipe", 1, (6,), "never"), [budget]) is None  # no host copy: none
    costs.host_copy = FAST
    chosen = search(costs, 1, budget, checkpoints=("never",), runners_up=2)
    assert any(chosen.candidate.offload), chosen.candidate.describe()
    assert chosen.best.peak <= budget
    table = chosen.table()
    assert "offload planned: host copy 5 us + 20.0 GB/s each way" in table and "offload=[" in table
    kwargs = chosen.pipe_kwargs()
    assert kwargs["recompute"]["swap_config"]["layer_swap"][0]["layers"] == list(range(chosen.candidate.offload[0]))
    piped, plain = Pipe(copy.deepcopy(model), **kwargs), copy.deepcopy(model)
    out, expected = piped(x), plain(x)
    F.mse_loss(out, target).backward()
    F.mse_loss(expected, target).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(piped.parameters(), plain.parameters()):  # summed over micro-batches: in another order
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)


def test_an_offloading_transformer_counts_and_runs_as_planned() -> None:
    # Real blocks: embedding, causal attention with its mask, LayerNorm, the head; two stages offloading.
    model = build_model(vocab_size=32, width=32, layers=4, heads=4, seq_len=16, dropout=0.0)
    tokens = torch.randint(0, 32, (8, 16))
    target = torch.randn(8, 16, 32)
    costs = profile_costs(model, tokens, (1, 2), rounds=1, loss_fn=F.mse_loss, target=target)
    costs.host_copy = FAST
    candidate = Candidate("gpipe", 2, (3, 3), "never", offload=(2, 1))
    config = candidate.recompute_config()
    assert config == {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 1, 3]}]}}
    none, offloaded = predict(costs, Candidate("gpipe", 2, (3, 3), "never")), predict(costs, candidate)
    assert all(a < b for a, b in zip(offloaded.peaks, none.peaks))
    piped = Pipe(copy.deepcopy(model), chunks=2, balance=[3, 3], checkpoint="never", recompute=config)
    plain = copy.deepcopy(model)
    out, expected = piped(tokens), plain(tokens)
    F.mse_loss(out, target).backward()
    F.mse_loss(expected, target).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    for a, b in zip(piped.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_offload_plans_that_cannot_hold_are_refused_with_the_reason() -> None:
    costs = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [1000] * 4, [100] * 4, host_copy=FAST)
    for bad, words in ((Candidate("gpipe", 2, (4,), "always", offload=(1,)), "checkpoint='never'"),
                       (Candidate("gpipe", 2, (4,), "never", recompute=(1,), offload=(2,)), "offloads or recomputes"),
                       (Candidate("zb-h1", 2, (2, 2), "never", offload=(1, 1)), "zero-bubble"),
                       (Candidate("gpipe", 2, (2, 2), "never", offload=(3, 1)), "between 0 and")):
        with pytest.raises(ValueError, match=words):
            predict(costs, bad)
    without = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [1000] * 4, [100] * 4)
    with pytest.raises(ValueError, match="CUDA device"):
        predict(without, Candidate("gpipe", 2, (4,), "never", offload=(1,)))
    with pytest.raises(ValueError, match="CUDA device"):
        measure_host_copy(torch.device("cpu"))
    with pytest.raises(ValueError, match="per_byte"):
        HostCopy(1e-6, float("nan"))


def _build() -> nn.Sequential:  # at module level: the plans' ranks may be started by a fork server
    return mlp(layers=4, width=32)


def test_distributed_offload_plans_are_counted_to_the_byte_on_every_rank() -> None:
    # DistributedPipe copies a cell's units back as the action before its backward starts, all of them;
    # a unit made by that very action (a forward right before its backward) comes back as it is used.
    from pipe.plan.measure import run_plans

    x, y = torch.randn(16, 32), torch.randn(16, 32)
    costs = profile_costs(_build(), x, (2, 4), rounds=1, loss_fn=F.mse_loss, target=y, stages=2)
    costs.host_copy = FAST
    plans = [Candidate("1f1b", 4, (2, 2), "never", offload=(1, 1)), Candidate("gpipe", 2, (3, 1), "never", offload=(2, 0)),
             Candidate("1f1b", 2, (3, 1), "never", offload=(3, 0)), Candidate("gpipe", 2, (1, 3), "never", offload=(0, 3)),
             Candidate("interleaved", 4, (1, 1, 1, 1), "never", 2, offload=(1, 1, 1, 1))]
    measured = run_plans(_build, plans, x, y, F.mse_loss)
    for candidate, ranks in zip(plans, measured):
        predicted = predict(costs, candidate, runner="processes")
        unmarked = predict(costs, replace(candidate, offload=()), runner="processes")
        for m in ranks:
            assert m.activation_peak == predicted.peaks[m.pipeline_rank] - predicted.static[m.pipeline_rank], \
                (candidate.describe(), m)
        assert predicted.peaks != unmarked.peaks, candidate.describe()  # the plans' offload shows
    gpipe = predict(costs, plans[1], runner="processes")  # rank 0 offloads: it holds less
    assert gpipe.peaks[0] < predict(costs, replace(plans[1], offload=()), runner="processes").peaks[0]
    sharded = Candidate("1f1b", 2, (2, 2), "never", dp_shard=2, offload=(2, 1))  # FSDP2 over 2 of 4 ranks
    predicted = predict(costs, sharded, runner="processes")
    for m in run_plans(_build, [sharded], x, y, F.mse_loss)[0]:
        assert m.activation_peak == predicted.peaks[m.pipeline_rank] - predicted.static[m.pipeline_rank], m


@pytest.mark.cuda
def test_on_the_gpu_an_offload_plan_fits_its_budget_and_matches_the_plain_model() -> None:
    device = torch.device("cuda", 0)
    model = mlp(layers=6, width=1024)
    x, target = torch.randn(512, 1024), torch.randn(512, 1024)
    costs = profile_costs(model, x, (1, 2), rounds=2, device=device, loss_fn=F.mse_loss, target=target.to(device))
    assert costs.host_copy is not None and costs.host_copy.per_byte > 0
    never = predict(costs, Candidate("gpipe", 1, (6,), "never"))
    # Offloading every layer leaves 57% of the activation peak here: the backward's own bytes, and the
    # units copied back (the one in use and the one prefetched).
    budget = int(never.static[0] + 0.7 * (never.peak - never.static[0]))
    planned = per_stage_offload(costs, Candidate("gpipe", 1, (6,), "never"), [budget])
    assert planned is not None and any(planned.offload)
    predicted = predict(costs, planned)
    gx, gt = x.to(device), target.to(device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    piped = Pipe(copy.deepcopy(model).to(device), devices=["cuda:0"], chunks=planned.chunks, balance=[6],
                 checkpoint="never", recompute=planned.recompute_config())
    for _ in range(2):
        piped.zero_grad(set_to_none=True)
        F.mse_loss(piped(gx), gt).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    piped.zero_grad(set_to_none=True)
    out = piped(gx)
    F.mse_loss(out, gt).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    assert peak <= 1.1 * predicted.peak, (peak, predicted.peak)
    plain = copy.deepcopy(model).to(device)
    expected = plain(gx)
    F.mse_loss(expected, gt).backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # cuBLAS may pick other kernels per size
    for a, b in zip(piped.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_an_offload_plan_on_a_split_gpt2_with_tied_weights_and_padding_matches_the_plain_model() -> None:
    # A HuggingFace GPT-2 cut by pipe.split: its tied embedding and head stay on the device (parameters),
    # the padding mask and the hidden states go to host memory and come back; loss and gradients are
    # the plain model's.
    pytest.importorskip("transformers")
    import pipe
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from split_models import assert_same_lm_step, gpt2, lm_batch, lm_loss

    torch.manual_seed(0)
    model = gpt2(layers=2)
    ids, mask, labels = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["transformer.h.1"])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    costs = profile_costs(stages, (ids, mask), (1, 2), rounds=1, loss_fn=lm_loss, target=labels)
    costs.host_copy = FAST
    never = Candidate("gpipe", 2, (1, 1), "never")
    planned = per_stage_offload(costs, never, [int(p * 0.97) for p in predict(costs, never).peaks])
    assert planned is not None and any(planned.offload), planned
    reference = copy.deepcopy(model)
    piped = Pipe(stages, chunks=planned.chunks, balance=list(planned.balance), checkpoint="never",
                 recompute=planned.recompute_config())
    assert piped.recompute_strategy is not None and any(o is not None for o in piped.recompute_strategy.offloaders)
    assert_same_lm_step(piped, model, reference, ids, mask, labels)
    piped.close()


def test_a_split_llamas_offload_plans_are_counted_as_they_run_on_ranks() -> None:
    # LLaMA through pipe.split over 2 ranks: the rotary tables (buffers' products, no gradient) and the
    # mask ride with the hidden state; offloading stages' peaks as counted on the ranks, to the byte. (Its
    # first stage's warm-up graph outlives the warm-up: the profile's count discards its units, else the
    # counted forward's would prefetch them.)
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spawn_ranks import run_ranks
    from split_models import lm_batch, lm_loss
    from test_cost import _measure_lm, _split_llama

    plans = [Candidate("1f1b", 4, (2, 2), "never", offload=(2, 1)), Candidate("gpipe", 2, (2, 2), "never", offload=(1, 2))]
    measured = run_ranks(_measure_lm, 2, plans, deadline=300)
    ids, mask, labels = lm_batch(8, 8)
    costs = profile_costs(_split_llama(), (ids, mask), (2, 4), rounds=1, loss_fn=lm_loss, target=labels)
    costs.host_copy = FAST
    for k, candidate in enumerate(plans):
        predicted = predict(costs, candidate, runner="processes")
        for rank in range(2):
            assert measured[rank][k] == predicted.peaks[rank] - predicted.static[rank], (candidate.describe(), rank)
