"""Checkpoint and Recompute: pass flags, RNG replay, order of recomputation."""
import copy

import pytest
import torch
from torch import nn

import pipe
from pipe import Pipe, is_checkpointing, is_recomputing
from pipe.core.checkpoint import Checkpointing
from pipe.core.microbatch import Batch


class Flags(nn.Module):
    """Records (is_checkpointing, is_recomputing) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.calls.append((is_checkpointing(), is_recomputing()))
        return x * 2


def test_flags_outside_any_pass():
    assert not is_checkpointing()
    assert not is_recomputing()


def test_flags_in_each_pass():
    flags = Flags()
    piped = Pipe(nn.Sequential(nn.Linear(3, 3), flags), chunks=2, checkpoint="except_last", balance=[1, 1], devices=["cpu", "cpu"])
    piped(torch.randn(4, 3)).sum().backward()
    # micro-batch 0: checkpointed forward, then recomputation; micro-batch 1: plain forward.
    assert sorted(flags.calls) == sorted([(True, False), (False, False), (False, True)])
    assert flags.calls[-1] == (False, True)  # recomputation happens in backward


def test_checkpointing_record_alone():
    """The record used by both pipelines works on its own: checkpoint, recompute, backward."""
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    chk = Checkpointing(lambda batch: batch.call(layer), Batch(x))
    out = chk.checkpoint()
    chk.recompute(out)
    out.tensor.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref_layer = copy.deepcopy(layer)
    ref_layer.zero_grad()
    layer_grad = layer.weight.grad.clone()
    ref_layer(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(layer_grad, ref_layer.weight.grad)


class MaskRecorder(nn.Module):
    """Dropout that remembers its masks per pass, to compare forward and recomputation."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.forward_masks: list[torch.Tensor] = []
        self.recompute_masks: list[torch.Tensor] = []

    def forward(self, x):
        mask = (torch.rand_like(x) > self.p).to(x.dtype)
        (self.recompute_masks if is_recomputing() else self.forward_masks).append(mask)
        return x * mask / (1 - self.p)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recompute_replays_dropout(checkpoint):
    torch.manual_seed(0)
    first, second = MaskRecorder(), MaskRecorder()
    model = nn.Sequential(nn.Linear(8, 8), first, nn.Linear(8, 8), second)
    piped = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 2], devices=["cpu", "cpu"])
    for _ in range(3):  # several steps: the first probes randomness, later ones run with the guard
        for rec in (first, second):
            rec.forward_masks.clear()
            rec.recompute_masks.clear()
        piped(torch.randn(16, 8)).sum().backward()
        for rec in (first, second):
            checkpointed = 4 if checkpoint == "always" else 3
            assert len(rec.recompute_masks) == checkpointed
            # recomputation runs backward, from the last micro-batch to the first
            for fwd, rec_mask in zip(rec.forward_masks[:checkpointed], reversed(rec.recompute_masks)):
                assert torch.equal(fwd, rec_mask)


def test_dropout_gradients_match_a_manual_replay():
    """With the masks fixed, gradients through dropout under recomputation equal the plain model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8), nn.Dropout(0.3))
    x = torch.randn(4, 8)
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=1, checkpoint="always", balance=[2, 2], devices=["cpu", "cpu"])
    torch.manual_seed(1)
    y_plain = plain(x)
    torch.manual_seed(1)
    y_piped = piped(x)
    torch.testing.assert_close(y_piped, y_plain)
    y_plain.sum().backward()
    y_piped.sum().backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_recompute_starts_before_checkpoint_backward():
    events = []

    class Probe(nn.Module):
        def forward(self, x):
            if is_recomputing():
                events.append("recompute")
            return x.clone()

    piped = Pipe(nn.Sequential(nn.Linear(2, 2), Probe()), chunks=1, checkpoint="always")
    out = piped(torch.randn(2, 2))
    out.register_hook(lambda grad: events.append("gradient arrives"))
    from pipe.core.checkpoint import Checkpoint

    original = Checkpoint.backward

    def backward(ctx, *grads):
        events.append("checkpoint backward")
        return original(ctx, *grads)

    Checkpoint.backward = staticmethod(backward)
    try:
        out.sum().backward()
    finally:
        Checkpoint.backward = staticmethod(original)
    assert events == ["gradient arrives", "recompute", "checkpoint backward"]


def test_public_names():
    assert pipe.is_checkpointing is is_checkpointing
    assert pipe.is_recomputing is is_recomputing


def test_dropout_is_reproducible_with_concurrent_partitions():
    """Two CPU partitions with dropout take turns on the shared generator in any order;
    each cell's own seeded stream makes a seeded run repeat exactly."""

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.5))
        piped = Pipe(model, chunks=8, checkpoint="except_last", balance=[2, 2], devices=["cpu", "cpu"])
        x = torch.randn(32, 64)
        outs = [piped(x) for _ in range(3)]
        torch.stack(outs).sum().backward()
        grads = [p.grad.clone() for p in piped.parameters()]
        piped.close()
        return torch.stack(outs).detach(), grads

    reference = run()
    for _ in range(5):
        outs, grads = run()
        assert torch.equal(outs, reference[0])
        assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))


class WithTable(nn.Module):
    """A linear layer that also returns a table made from a buffer, as LLaMA's first stage passes on its
    rotary cos and sin; with ``from_weight``, the table is made from the weight (it needs a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))
        self.from_weight = False

    def forward(self, x):
        source = self.lin.weight[0] if self.from_weight else self.table
        return self.lin(x), source.expand(x.size(0), 4) * 1.0


class UseTable(nn.Module):
    """Multiplies by the table; records whether the table it got needs a gradient, outside replays."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.needs: list[bool] = []

    def forward(self, pair):
        x, table = pair
        if not is_recomputing():
            self.needs.append(table.requires_grad)
        return self.lin(x) * table


def test_a_checkpointed_partition_passes_tables_made_from_buffers_without_a_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(WithTable(), UseTable())
    reference = copy.deepcopy(model)
    piped = Pipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    for step in range(2):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        model[1].needs.clear()
        piped(x).sum().backward()
        reference(x).sum().backward()
        for (name, got), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, expected.grad, msg=name)
    # The first step's checkpointed forwards cannot know; its replays (with grad on) tell the partition.
    assert model[1].needs == [False, False]


def test_an_output_that_starts_needing_a_gradient_is_refused_not_dropped():
    torch.manual_seed(0)
    model = nn.Sequential(WithTable(), UseTable())
    piped = Pipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    piped(torch.randn(4, 4)).sum().backward()  # learns: the table needs no gradient
    model[0].from_weight = True  # now it does: the checkpointed forward passed it on without one
    with pytest.raises(RuntimeError, match=r"recomputed output tensor\(s\) \[1\].*needing a gradient.*refused"):
        piped(torch.randn(4, 4)).sum().backward()
    model.zero_grad()
    x = torch.randn(4, 4)
    piped(x).sum().backward()  # the next step knows, and is exact
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(x).sum().backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)
