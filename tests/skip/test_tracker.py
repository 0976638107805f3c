"""Skips through the pipeline: the plain network is the oracle, whatever partitions the skip spans."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import Tensor, nn

from models import PopLinear, StashLinear, plain_forward, skip_model
from pipe import Pipe
from pipe.skip import Namespace, pop, skippable, stash
from pipe.skip.tracker import SkipTracker, use_skip_tracker
from pipe.skip.tracker import current_skip_tracker

pytestmark = pytest.mark.filterwarnings("ignore:.*oversubscribe")

MODES = ["always", "except_last", "never"]
# Stash in layer 0, pop in layer 5: a skip inside one partition, to the next, across several.
BALANCES = {"span0": [6], "span1": [3, 3], "span2": [2, 2, 2], "span5": [1, 1, 1, 1, 1, 1]}


def run_both(model: nn.Sequential, balance: list[int], chunks: int, checkpoint: str) -> None:
    oracle = copy.deepcopy(model)
    x = torch.randn(6, 4, requires_grad=True)
    x_oracle = x.detach().clone().requires_grad_()
    pipe = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=balance, devices=["cpu"] * len(balance),
                cpu_threads=1)
    try:
        output = pipe(x)
        output.square().sum().backward()
    finally:
        pipe.close()
    expected = plain_forward(oracle, x_oracle)
    expected.square().sum().backward()
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(x.grad, x_oracle.grad)
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("span", list(BALANCES))
def test_skip_matches_plain_network(span: str, chunks: int, checkpoint: str) -> None:
    run_both(skip_model(), BALANCES[span], chunks, checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_block_reused_with_namespaces(checkpoint: str) -> None:
    # The same stash/pop names twice, told apart by namespaces, interleaved over 3 partitions.
    torch.manual_seed(1)
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        StashLinear(4).isolate(ns1), StashLinear(4).isolate(ns2), nn.Linear(4, 4),
        PopLinear(4).isolate(ns1), nn.Tanh(), PopLinear(4).isolate(ns2),
    )
    run_both(model, [2, 2, 2], 2, checkpoint)


@skippable(stash=["nothing"])
class StashNone(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("nothing", None)
        return x * 2


@skippable(pop=["nothing"])
class PopNone(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        nothing = yield pop("nothing")
        assert nothing is None
        return x + 1


@pytest.mark.parametrize("checkpoint", MODES)
def test_none_can_be_stashed(checkpoint: str) -> None:
    model = nn.Sequential(StashNone(), nn.Linear(4, 4), PopNone())
    pipe = Pipe(model, chunks=2, checkpoint=checkpoint, balance=[1, 1, 1], devices=["cpu"] * 3, cpu_threads=1)
    x = torch.randn(4, 4, requires_grad=True)
    pipe(x).sum().backward()
    pipe.close()
    assert x.grad is not None


@skippable(stash=["mask"])
class StashMask(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("mask", x > 0)  # a bool tensor: no gradient
        return x


@skippable(pop=["mask"])
class PopMask(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        mask = yield pop("mask")
        return x * mask


@pytest.mark.parametrize("checkpoint", MODES)
def test_non_differentiable_skip(checkpoint: str) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 4), StashMask(), nn.Linear(4, 4), PopMask())
    oracle = copy.deepcopy(model)
    x = torch.randn(4, 4)
    pipe = Pipe(model, chunks=2, checkpoint=checkpoint, balance=[2, 1, 1], devices=["cpu"] * 3, cpu_threads=1)
    pipe(x).sum().backward()
    pipe.close()
    h = oracle[0](x)
    (oracle[2](h) * (h > 0)).sum().backward()
    for p, q in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_eval_and_no_grad() -> None:
    model = skip_model()
    oracle = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3, cpu_threads=1).eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain_forward(oracle, x))
    pipe.close()


@skippable(stash=["skip"])
class StashFresh(nn.Module):
    """Stashes a fresh tensor and keeps a weak reference to it (and to its storage's owner)."""

    refs: list[weakref.ref] = []

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = x * 3
        StashFresh.refs.append(weakref.ref(skip))
        yield stash("skip", skip)
        return x + 1


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip  # add saves nothing for backward


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[3], [1, 1, 1]])
def test_skip_tensors_are_freed_when_no_longer_needed(checkpoint: str, balance: list[int]) -> None:
    model = nn.Sequential(StashFresh(), nn.Linear(4, 4), PopAdd())
    pipe = Pipe(model, chunks=2, checkpoint=checkpoint, balance=balance, devices=["cpu"] * len(balance),
                cpu_threads=1)
    for _ in range(3):
        StashFresh.refs = []
        x = torch.randn(4, 4, requires_grad=True)
        output = pipe(x)  # no garbage collection below: reference counting alone must free the skips
        alive = [ref() is not None for ref in StashFresh.refs]
        # Without recomputation nobody needs a skip once popped; with it, the
        # checkpointed micro-batches keep theirs for the recomputed pop.
        assert alive == ([False, False] if checkpoint == "never" or balance == [3] else
                         [True, False] if checkpoint == "except_last" else [True, True])
        output.sum().backward()
        # Backward is done: the output (and its graph) still exist, the skips do not.
        assert all(ref() is None for ref in StashFresh.refs)
        assert len(StashFresh.refs) == 2 + (2 if checkpoint == "always" else 1 if checkpoint == "except_last" else 0)
    pipe.close()


def test_skippable_model_runs_without_pipe() -> None:
    model = skip_model()
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), plain_forward(model, x))
    assert current_skip_tracker().tensors == {}


def test_tracker_load_unstashed_names_the_skip() -> None:
    with use_skip_tracker(SkipTracker()):
        with pytest.raises(RuntimeError, match="'skip' is popped but was not stashed"):
            PopLinear(4)(torch.randn(1, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("devices", [["cpu", "cuda:0", "cuda:0"], ["cuda:0", "cpu", "cuda:0"]])
def test_skip_copied_between_devices(checkpoint: str, devices: list[str]) -> None:
    # The skip goes from partition 0 to partition 2 through a portal copy, skipping partition 1.
    model = skip_model()
    oracle = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 2, 2], devices=devices, cpu_threads=1)
    x = torch.randn(6, 4, device=devices[0], requires_grad=True)
    output = pipe(x)
    assert output.device == torch.device(devices[-1])
    output.square().sum().backward()
    pipe.close()
    x_oracle = x.detach().cpu().requires_grad_()
    expected = plain_forward(oracle, x_oracle)
    expected.square().sum().backward()
    torch.testing.assert_close(output.cpu(), expected)
    torch.testing.assert_close(x.grad.cpu(), x_oracle.grad)
    for p, q in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad)
