"""Gradient accumulation over several steps (``step(..., accumulate=True)``) against the plain model, 4 gloo ranks.

Each layout takes 3 passes before one optimizer step; the passes hold
different numbers of tokens (and of sequences), and so do the data-parallel
ranks within a pass. The plain model in each process computes the loss over
every pass's global batch at once (the token mean for ``"count"``, the sample
mean for ``"mean"``) and one backward: the pipeline's gradients after the last
pass must equal its gradients within 1e-6 of the gradient's largest element
(fp32 rounding only: a pass divided by its own count, or reduced on its own,
is off by a factor of the gradient). Layouts: replicas (pp 2, dp_replicate 2),
FSDP (pp 2, dp_shard 2: ZeRO-3 with a tied embedding, and ZeRO-2 under the
zero-bubble "zbv", whose W steps accumulate the weight gradients; reduce-scatters
only in the pass that ends the accumulation; and ``Shard(unit="block", reduce="micro-batch")``,
which reduce-scatters in every pass), tensor parallelism (pp 2, tp 2),
pipeline only (pp 4, interleaved).
Misuse is refused: an optimizer step, ``eval_step``, ``clip_grad_norm_`` while
accumulating.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pipe.distributed as pd
from decoder import decoder, full, tensor_parallel_plan
from spawn_ranks import hold_the_store, run_ranks
from test_fsdp_ranks import Collectives, lm

VOCAB = 11  # test_fsdp_ranks.lm's; the decoder's is 32
PASSES = [(8, 3), (4, 3), (6, 3)]  # (sequences, tokens) of each pass's global batch: uneven sizes
# Of the largest element of each gradient. float32: at most 9.6e-7 was seen here (1e-6 is the aim); the bound
# leaves room for another CPU's kernels (decoder.train_against's note). float64: rounding only, the exactness check.
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}


def data(step: int, rows: int, length: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Ids and labels; rows end in padding (-100) of different lengths, so passes and ranks hold uneven tokens."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = torch.randint(0, vocab, (rows, length), generator=generator)
    for row in range(rows):
        labels[row, length - (row + step) % length:] = -100
    labels[0, 0] = 1  # no batch without a token
    return ids, labels


def token_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def sample_mean(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten())


def rows_of(pipe: pd.DistributedPipe, rows: int) -> slice:
    """This rank's rows of a global batch: unequal shares (the first replica takes the larger)."""
    parts, part = pipe.topology.data_parallel, pipe.topology.replica
    if parts == 1:
        return slice(0, rows)
    cut = rows // 2 + (1 if rows >= 6 else 0)
    return slice(0, cut) if part == 0 else slice(cut, rows)


def accumulate_against_plain(piped: pd.DistributedPipe, plain: nn.Module, reduction: str, vocab: int,
                             label: str, before: bool = False) -> dict[str, Any]:
    """3 passes of ``piped`` (the first two with ``accumulate=True``) against one backward of ``plain``.

    With ``before``, one ordinary step first, which the accumulation must add to, not replace.
    Returns the largest relative gradient difference, and the reduce-scatters of each pass.
    """
    loss_fn: Callable[..., Any] = token_sum if reduction == "count" else sample_mean
    batches = [data(step, rows, length, vocab) for step, (rows, length) in enumerate(PASSES)]
    if before:
        ids, labels = data(9, 4, 3, vocab)
        piped.step(ids[rows_of(piped, 4)], labels[rows_of(piped, 4)], loss_fn)
        plain_before = loss_fn(plain(ids), labels)
        (plain_before[0] / plain_before[1] if reduction == "count" else plain_before).backward()
    scatters = []
    loss = None
    for k, (ids, labels) in enumerate(batches):
        part = rows_of(piped, ids.size(0))
        with Collectives() as collectives:
            loss = piped.step(ids[part], labels[part], loss_fn, accumulate=k < len(batches) - 1, broadcast_loss=True)
        scatters.append(collectives.counts["reduce_scatter"])
        if k < len(batches) - 1:
            assert loss is None, f"{label}: a pass that accumulates returned {loss}"
    if reduction == "count":
        sums = [token_sum(plain(ids), labels) for ids, labels in batches]
        expected = sum(s for s, _ in sums) / sum(c for _, c in sums)
    else:
        rows = sum(ids.size(0) for ids, _ in batches)
        expected = sum(sample_mean(plain(ids), labels) * ids.size(0) for ids, labels in batches) / rows
    expected.backward()
    assert loss is not None
    torch.testing.assert_close(loss, expected.detach().float(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{label}: loss {m}")
    plain_parameters = dict(plain.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, parameter in piped.named_parameters():
        got, want = full(parameter.grad), plain_parameters[name].grad
        assert want is not None and got is not None, f"{label}: {name} has no gradient"
        relative = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
        assert relative <= TOLERANCE[want.dtype], f"{label}: {name}'s gradient is off by {relative:.3g} of its largest element"
        worst = max(worst, relative)
    return {"worst": worst, "reduce_scatters": scatters}


def _layouts(rank: int, world: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for dtype in (torch.float64, torch.float32):
        name = str(dtype).split(".")[-1]

        def check(plain: nn.Module, reduction: str, label: str, vocab: int = VOCAB, before: bool = False,
                  **options: Any) -> None:
            plain = plain.to(dtype)
            piped = pd.DistributedPipe(copy.deepcopy(plain), loss_reduction=reduction, **options)
            report[f"{label} {name}"] = accumulate_against_plain(piped, plain, reduction, vocab, f"{label} {name}",
                                                                 before=before)

        # Replicas; one ordinary step before, which the accumulation adds to.
        for reduction in ("count", "mean"):
            check(lm(tied=False), reduction, f"replicas {reduction}", before=reduction == "count", chunks=2,
                  mesh=pd.make_mesh(pp=2, dp_replicate=2))
        # FSDP: ZeRO-3 with the embedding tied to the head (first and last stage), ZeRO-2.
        check(lm(tied=True), "count", "fsdp count", chunks=2, schedule="1f1b", mesh=pd.make_mesh(pp=2, dp_shard=2))
        check(lm(tied=False), "mean", "fsdp zero2 mean", chunks=2, schedule="zbv", virtual_stages=2,
              mesh=pd.make_mesh(pp=2, dp_shard=2), shard=pd.Shard(reshard_after_forward=False))  # weights in W
        # FSDP gathering a layer at a time, each layer's gradients reduce-scattered after each of its backwards:
        # the passes that accumulate reduce too, into the sharded gradients, which the last pass divides.
        check(lm(tied=False), "count", "fsdp by layer count", chunks=2, schedule="1f1b",
              mesh=pd.make_mesh(pp=2, dp_shard=2), shard=pd.Shard(unit="block", reduce="micro-batch"))
        # Tensor parallelism (Megatron's split of the decoder's blocks).
        check(decoder(0), "count", "tp count", vocab=32, chunks=2, mesh=pd.make_mesh(pp=2, tp=2),
              tensor_parallel=tensor_parallel_plan(False))
        # Pipeline only, 4 stages, an interleaved schedule.
        check(lm(tied=False), "count", "pp4 interleaved count", chunks=4, schedule="interleaved", virtual_stages=2)
    report["refused"] = _refusals()
    return report


def _refusals() -> list[str]:
    """Misuse during an accumulation, refused on every rank alike; the accumulation goes on afterwards."""
    plain = lm(tied=False)
    piped = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, mesh=pd.make_mesh(pp=2, dp_replicate=2),
                               loss_reduction="count")
    optimizer = torch.optim.SGD(piped.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    ids, labels = data(0, 4, 3, VOCAB)
    part = rows_of(piped, 4)
    piped.step(ids[part], labels[part], token_sum, accumulate=True)
    refused = []
    for call, where in ((optimizer.step, "SGD.step()"), (lambda: piped.eval_step(ids[part], labels[part], token_sum),
                                                         "eval_step()"),
                        (lambda: piped.clip_grad_norm_(1.0), "clip_grad_norm_()")):
        with pytest.raises(RuntimeError, match=rf"{where.replace('(', '[(]').replace(')', '[)]')} while 1 pass"):
            call()
        refused.append(where)
    other.step()  # another model's optimizer is not concerned
    with pytest.raises(TypeError, match="accumulate"):
        piped.step(ids[part], labels[part], token_sum, accumulate=1)  # type: ignore[arg-type]
    piped.step(ids[part], labels[part], token_sum)  # the last pass
    optimizer.step()  # allowed again
    return refused


def test_accumulation_equals_plain_model() -> None:
    reports = run_ranks(_layouts, 4, deadline=300.0, timeout=60.0)
    report = reports[0]
    for label, result in report.items():
        if label != "refused":
            print(f"\n{label}: largest gradient difference {result['worst']:.3g} of the gradient's largest element")
    assert report["refused"] == ["SGD.step()", "eval_step()", "clip_grad_norm_()"]
    for reports_of_rank in reports:
        for label in ("fsdp count float32", "fsdp zero2 mean float64"):  # each rank: one reduce-scatter per stage, at the last pass
            assert reports_of_rank[label]["reduce_scatters"][:2] == [0, 0], (label, reports_of_rank[label])
            assert reports_of_rank[label]["reduce_scatters"][2] > 0, (label, reports_of_rank[label])
        assert reports_of_rank["replicas count float32"]["reduce_scatters"] == [0, 0, 0]
        assert all(count > 0 for count in reports_of_rank["fsdp by layer count float32"]["reduce_scatters"])


def _disagreeing(rank: int, world: int) -> str:
    """Ranks 0 and 1 pass accumulate=True, ranks 2 and 3 False, in the same step: what each raises."""
    piped = pd.DistributedPipe(lm(tied=False), chunks=2, mesh=pd.make_mesh(pp=2, dp_replicate=2),
                               loss_reduction="count")
    ids, labels = data(0, 4, 3, VOCAB)
    part = rows_of(piped, 4)
    try:
        piped.step(ids[part], labels[part], token_sum, accumulate=rank < 2)
        message = "no error"
    except Exception as error:
        message = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    hold_the_store(rank, world)  # every rank's verdict read the store, which rank 0 hosts
    return message


def test_ranks_that_disagree_on_accumulate_are_refused_on_every_rank_without_waiting_out_the_timeout() -> None:
    # Without the check, the ranks that reduce wait on those that do not until the timeout, and are told of a
    # stalled rank; with it, the rank that comes later raises and every rank names its error.
    reports = run_ranks(_disagreeing, 4, timeout=30.0, deadline=120.0, barrier=False)
    for rank, message in enumerate(reports):
        assert "accumulate=" in message and "every rank must pass the same value" in message, (rank, message)
        assert "stalled" not in message, (rank, message)
