"""Orders built from costs (pipe.schedule_from_costs, pipe.plan.auto_schedule) on 2 gloo ranks train exactly
like the plain module: the V and the looped placement, every checkpoint mode, a skip across ranks, and a weight
tied across ranks with the cut and the order measured on rank 0 and shared with the other."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dist_models import (WIDTH, batch, blocks, check_against_oracle, check_table_steps, skip_model,
                         train_tokens_against)
from pipe import StageCosts, schedule_from_costs
from pipe.distributed import DistributedPipe
from pipe.plan import calibrated_schedule
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import VOCAB, tied_model  # noqa: E402

CHECKPOINTS = ("always", "except_last", "never")
# Uneven on purpose: the first stage's I empty, W 2.3x an I, a heavier last stage; a fixed schedule loses here.
COSTS = StageCosts.of([1.0, 1.0, 1.0, 1.6], [0.0, 1.0, 1.0, 1.3], [2.3, 2.3, 2.3, 3.0], transfer=0.1)


def _orders(rank: int, world: int) -> list[str]:
    checked = []
    for placement in ("v", "looped"):
        for checkpoint in CHECKPOINTS:
            table = schedule_from_costs(COSTS, ranks=2, microbatches=4, placement=placement, checkpoint=checkpoint)
            assert table.name == "auto" and table.splits_backward
            check_table_steps(rank, table, checkpoint, f"auto {placement}/{checkpoint}", balance=[1, 2, 3, 2])
            checked.append(f"{placement}/{checkpoint}")
        # A skip from layer 1 (stage 0, rank 0) to layer 5 (stage 2: rank 1 in the V, rank 0 looped).
        model = skip_model(1, 5, 8)
        table = schedule_from_costs(COSTS, ranks=2, microbatches=4, placement=placement, checkpoint="except_last")
        piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint="except_last", schedule=table)
        generator = torch.Generator().manual_seed(3)
        x, target = torch.randn(10, WIDTH, generator=generator), torch.randn(10, WIDTH, generator=generator)
        check_against_oracle(piped, model, x, target, piped.step(x, target, F.mse_loss), f"skip {placement}")
        checked.append(f"skip {placement}")
    # Orders the greedy rule won for other costs: one stage per rank, and more of both placements.
    for seed, (forward, input_grad, weight_grad) in enumerate(MORE):
        table = schedule_from_costs(StageCosts.of(forward, input_grad, weight_grad, transfer=0.1), ranks=2,
                                    microbatches=4, checkpoint="except_last")
        assert table.name == "auto"
        model = blocks(8)
        piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint="except_last", schedule=table,
                                loss_fn=F.mse_loss)
        inputs, target = batch(10, seed)
        check_against_oracle(piped, model, inputs, target, piped.step(inputs, target), f"more {seed}")
        checked.append(f"{table.stages} stages")
    return checked


MORE = [([1.7, 1.3], [1.1, 0.9], [3.0, 1.0]), ([0.9, 1.4], [1.0, 1.5], [2.3, 2.7]),
        ([1.8, 1.8, 1.7, 1.2], [1.7, 0.5, 1.6, 1.1], [1.9, 0.7, 1.5, 0.6]),
        ([1.4, 1.4, 1.7, 2.0], [0.3, 0.9, 0.4, 0.3], [0.2, 1.7, 2.8, 0.3])]


def test_auto_orders_match_the_plain_module() -> None:
    expected = [f"{p}/{c}" for p in ("v", "looped") for c in CHECKPOINTS]
    expected = expected[:3] + ["skip v"] + expected[3:] + ["skip looped"]
    expected += ["2 stages", "2 stages", "4 stages", "4 stages"]
    assert run_ranks(_orders, 2, deadline=240) == [expected, expected]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.logsumexp(-1) - output.gather(-1, target.unsqueeze(-1)).squeeze(-1)).mean()


def _tied(rank: int, world: int) -> list[str]:
    model = tied_model()
    sample = torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(0))
    # Timing differs between processes: rank 0 measures and decides, the other takes its choice (no trial steps).
    auto = calibrated_schedule(model, sample, chunks=4, loss_fn=_loss, checkpoint="except_last", rounds=0,
                               timeout=0.05)
    balance, table = auto.balance, auto.schedule
    checked = []
    for checkpoint in CHECKPOINTS:
        reference = copy.deepcopy(model)
        piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=table,
                                balance=balance, loss_fn=_loss)
        train_tokens_against(piped, reference, _loss, 2, lambda params: torch.optim.SGD(params, lr=0.1), VOCAB,
                             checkpoint)
        for name, value in piped.state_dict().items():
            torch.testing.assert_close(value, reference.state_dict()[name], msg=lambda m: f"{checkpoint} {name}: {m}")
        checked.append(checkpoint)
    return checked


def test_auto_schedule_of_a_tied_model_trains_like_the_plain_model() -> None:
    assert run_ranks(_tied, 2, deadline=240) == [list(CHECKPOINTS)] * 2


def _calibrated(rank: int, world: int) -> list[object]:
    model = blocks(8)
    before = copy.deepcopy(model.state_dict())
    inputs, target = batch(12, 0)
    auto = calibrated_schedule(model, inputs, target, chunks=4, loss_fn=F.mse_loss, checkpoint="except_last",
                               rounds=2, steps=1, timeout=0.05)
    step = auto.measured[-1] if auto.measured else None
    overheads = [s.overhead for s in auto.measured]
    found = [auto.balance, auto.schedule.to_csv(), step.steps if step else None, len(step.forward) if step else None,
             bool(step and all(f > 0 for f in step.forward) and step.overhead >= 0 and step.wall > 0),
             # the time model was read off the recorded steps: each phase's compute, the runner's time per action
             bool(overheads and min(overheads) <= auto.costs.overhead <= max(overheads)
                  and auto.model.phases != (1.0,) * 4)]
    # The trials ran on copies: the model's weights are as they were, and it has no gradients.
    found.append(all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
                 and all(p.grad is None for p in model.parameters()))
    piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint="except_last", schedule=auto.schedule,
                            balance=auto.balance, loss_fn=F.mse_loss)
    check_against_oracle(piped, model, inputs, target, piped.step(inputs, target), "calibrated auto")
    errors = []
    with torch.device("meta"):
        on_meta = blocks(8)
    for bad in ({"placement": "ring"}, {"pipe_options": {"schedule": "1f1b"}}, {"rounds": -1}, {"model": on_meta}):
        try:
            calibrated_schedule(**{"model": model, **bad}, inputs=inputs, target=target, chunks=4,  # type: ignore[arg-type]
                                loss_fn=F.mse_loss, timeout=0.01)
        except ValueError as error:
            errors.append(str(error).split(";")[0].split(":")[0])
    return found + [errors]


def test_calibrated_schedule_agrees_on_every_rank_and_trains_like_the_plain_model() -> None:
    found = run_ranks(_calibrated, 2, deadline=240)
    assert found[0] == found[1]  # rank 0's choice on both ranks
    balance, _, steps, stages, sane, overhead_used, untouched, errors = found[0]
    assert sum(balance) == 8 and steps == 1 and stages in (2, 4) and sane and overhead_used and untouched
    assert errors == ["placement must be one of ['best', 'looped', 'v'], got 'ring'",
                      "pipe_options may not give ['schedule']", "rounds must be an int >= 0 (trial runs to "
                      "calibrate by), got -1", "calibrated_schedule runs the model to time it"], errors
