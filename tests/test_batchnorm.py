"""Deferred BatchNorm: running statistics equal those of plain BatchNorm on the un-split batch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipe import Pipe
from pipe.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm

pytestmark = pytest.mark.filterwarnings("ignore:.*oversubscribe")


def bn_stats(module: nn.Module) -> list[Tensor]:
    return [t for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for t in (m.running_mean, m.running_var, m.num_batches_tracked)]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("shape", [(12, 3), (12, 3, 5, 5)], ids=["1d", "2d"])
def test_running_stats_equal_unsplit_batch(momentum: float | None, checkpoint: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    bn: nn.Module = nn.BatchNorm1d(3, momentum=momentum) if len(shape) == 2 else nn.BatchNorm2d(3, momentum=momentum)
    model = nn.Sequential(bn, nn.Flatten(), nn.Linear(3 * (25 if len(shape) == 4 else 1), 2))
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 2], devices=["cpu", "cpu"],
                deferred_batch_norm=True, cpu_threads=1)
    for step in range(4):
        x = torch.randn(*shape) * (step + 1) + step
        pipe(x).sum().backward()
        plain(x).sum().backward()
        for a, b in zip(bn_stats(pipe), bn_stats(plain)):
            torch.testing.assert_close(a, b)
    assert int(pipe[0].num_batches_tracked) == 4  # once per mini-batch, recomputation not counted
    pipe.close()


def test_conv_net_stats_outputs_and_eval() -> None:
    """A conv net over 2 partitions: each BN's running statistics are those of plain BN on its whole
    mini-batch input, outputs are the plain model applied per micro-batch, eval matches plain eval."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )
    initial = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, checkpoint="except_last", balance=[4, 5], devices=["cpu", "cpu"],
                deferred_batch_norm=True, cpu_threads=1)
    bns = [m for m in pipe.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(bns) == 2
    seen: dict[int, list[Tensor]] = {0: [], 1: []}
    hooks = [bn.register_forward_pre_hook(lambda m, args, k=k: seen[k].append(args[0].detach()))
             for k, bn in enumerate(bns)]
    reference = [copy.deepcopy(m) for m in initial.modules() if isinstance(m, nn.BatchNorm2d)]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(3):
        for k in seen:
            seen[k].clear()
        x = torch.randn(9, 2, 6, 6)
        snapshot = copy.deepcopy(model)  # parameters before this step, BN as the plain module
        output = pipe(x)
        # Outputs: the plain layers applied to each micro-batch (BN normalising with its statistics).
        for m in snapshot.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.track_running_stats = False
                m.running_mean = m.running_var = None
        torch.testing.assert_close(output, torch.cat([snapshot(c) for c in x.tensor_split(3)]))
        output.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for k, bn in enumerate(bns):
            # Recomputed micro-batches went through the hook too; the first forward of each is enough.
            whole = torch.cat(seen[k][:3])
            reference[k].train()(whole)
            torch.testing.assert_close(bn.running_mean, reference[k].running_mean)
            torch.testing.assert_close(bn.running_var, reference[k].running_var)
            assert int(bn.num_batches_tracked) == step + 1
    for hook in hooks:
        hook.remove()
    plain = copy.deepcopy(initial)
    plain.load_state_dict(pipe.state_dict())  # same keys: DeferredBatchNorm adds none
    pipe.eval()
    plain.eval()
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    before = [t.clone() for t in bn_stats(pipe)]
    with torch.no_grad():
        pipe(x)
    assert all(torch.equal(a, b) for a, b in zip(before, bn_stats(pipe)))  # eval updates nothing
    pipe.close()


def test_fewer_samples_than_chunks_still_commits() -> None:
    model = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1))
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=8, balance=[1, 1], devices=["cpu", "cpu"], deferred_batch_norm=True, cpu_threads=1)
    x = torch.randn(4, 2, 3, 3)
    with pytest.warns(UserWarning, match="smaller than chunks"):
        pipe(x)
    plain(x)
    for a, b in zip(bn_stats(pipe), bn_stats(plain)):
        torch.testing.assert_close(a, b)
    pipe.close()


class Fail(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("boom")


def test_failed_step_is_discarded() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2), nn.Identity())
    pipe = Pipe(model, chunks=2, balance=[1, 1], devices=["cpu", "cpu"], deferred_batch_norm=True, cpu_threads=1)
    bn = pipe[0]
    bn._pending.append((4, torch.full((2,), 100.0), torch.ones(2)))  # left over by a failed step
    x = torch.randn(4, 2)
    pipe(x)
    plain = nn.BatchNorm1d(2)
    plain(x)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    pipe.close()


def test_convert_keeps_parameters_buffers_and_skips_untracked() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.Sequential(nn.BatchNorm2d(2)), nn.BatchNorm2d(2, track_running_stats=False))
    weight = model[1][0].weight
    keys = list(model.state_dict())
    converted = convert_deferred_batch_norm(model)
    assert converted is model and isinstance(model[1][0], DeferredBatchNorm)
    assert model[1][0].weight is weight
    assert not isinstance(model[2], DeferredBatchNorm)
    assert list(model.state_dict()) == keys


def test_deferred_batch_norm_type_checked() -> None:
    with pytest.raises(TypeError, match="deferred_batch_norm must be True or False"):
        Pipe(nn.Sequential(nn.Linear(1, 1)), deferred_batch_norm="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_plain_batch_norm_is_not_updated_again_by_recomputation(checkpoint: str, chunks: int) -> None:
    # Without deferred_batch_norm the statistics move once per micro-batch, as the plain model
    # run on each micro-batch in turn; a checkpointed micro-batch's replay must not move them again.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[3, 2], devices=["cpu", "cpu"])
    x = torch.randn(8, 4)
    for part in x.tensor_split(chunks):
        plain(part)
    piped(x).sum().backward()
    for k in (1, 4):
        assert int(piped[k].num_batches_tracked) == int(plain[k].num_batches_tracked) == chunks
        torch.testing.assert_close(piped[k].running_mean, plain[k].running_mean)
        torch.testing.assert_close(piped[k].running_var, plain[k].running_var)
    piped.close()
