"""Tied parameters in Pipe: shared on one device, one weight copied per forward across devices; the plain model's steps."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipe import Pipe
from pipe.core.tying import find_ties, tie_partitions
from helpers import assert_same_grads
from split_models import VOCAB, assert_same_state, tied_model


# "cpu" and "cpu:0" are different devices to Pipe (so the tied weight is copied per forward) but the same memory:
# the cross-device path runs on a machine without GPUs.
@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu:0"]], ids=["one-device", "two-devices"])
@pytest.mark.parametrize("chunks,checkpoint", [(1, "never"), (4, "always"), (4, "except_last")])
def test_tied_weight_trains_like_the_plain_model(devices: list[str], chunks: int, checkpoint: str) -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    piped = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[2, 3], devices=devices)
    assert len(list(piped.parameters())) == len(list(reference.parameters()))  # one tied weight, one entry
    assert list(piped.state_dict()) == list(reference.state_dict())  # "0.weight" and "4.weight", as the plain model
    assert ("weight" in piped[4]._parameters) == (devices[0] == devices[1])  # else a copy made at each forward
    optimizer = torch.optim.Adam(piped.parameters(), lr=0.05)
    expected_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(4):
        x = torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
        loss = piped(x).logsumexp(-1).mean()
        expected = reference(x).logsumexp(-1).mean()
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        assert_same_grads(piped, reference, atol=1e-6, rtol=1e-5)
        optimizer.step()
        expected_optimizer.step()
    assert_same_state(piped, reference, atol=1e-5, rtol=1e-4)
    piped.close()


def test_checkpoint_of_the_plain_model_loads_across_devices() -> None:
    model = tied_model()
    piped = Pipe(model, balance=[2, 3], devices=["cpu", "cpu:0"])
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[0].weight.add_(1.0)
    piped.load_state_dict(other.state_dict())
    torch.testing.assert_close(piped.state_dict()["4.weight"], other[0].weight)
    fresh = tied_model()
    fresh.load_state_dict(piped.state_dict())
    assert_same_state(fresh, other, atol=0, rtol=0)
    piped.close()


def test_find_ties_names_every_holder() -> None:
    model = tied_model()
    ties = find_ties([model[:2], model[2:]])
    assert len(ties) == 1
    assert ties[0].partitions == [0, 1]
    assert (ties[0].name(0), ties[0].name(1)) == ("0.weight", "4.weight")


def test_buffer_shared_across_devices_is_refused() -> None:
    first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    second.running_mean = first.running_mean
    partitions = [nn.Sequential(first), nn.Sequential(second)]
    with pytest.raises(ValueError, match=r"buffer '0.running_mean' of partition 0 .* cannot be shared across devices"):
        tie_partitions(partitions, [torch.device("cpu"), torch.device("cpu", 0)])
    tie_partitions(partitions, [torch.device("cpu"), torch.device("cpu")])  # one device: shared as it is
