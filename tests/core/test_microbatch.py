"""Scatter and gather of structured micro-batches."""
import pytest
import torch

from pipe.core.microbatch import Batch, flatten, gather, scatter, unflatten


def test_flatten_roundtrip():
    value = (torch.ones(2), [3, {"a": torch.zeros(1), "b": None}], "s")
    leaves, spec = flatten(value)
    assert len(leaves) == 5
    rebuilt = unflatten(leaves, spec)
    assert rebuilt[1][1]["b"] is None and rebuilt[2] == "s" and isinstance(rebuilt[1], list)


def test_scatter_splits_tensors_and_replicates_the_rest():
    x = torch.arange(10).view(10, 1)
    batches = scatter((x, 7, None), chunks=4)
    assert [b.value[0].shape[0] for b in batches] == [3, 3, 2, 2]
    assert all(b.value[1] == 7 and b.value[2] is None for b in batches)
    assert torch.equal(gather(batches)[0], x)


def test_scatter_single_chunk_keeps_the_tensor():
    x = torch.randn(4, 2)
    (batch,) = scatter(x, 1)
    assert batch.value is not None and torch.equal(batch.value, x)


def test_gather_keeps_structure():
    batches = [Batch({"y": torch.full((2,), float(i)), "n": "x"}) for i in range(3)]
    out = gather(batches)
    assert out["n"] == "x"
    assert torch.equal(out["y"], torch.tensor([0.0, 0, 1, 1, 2, 2]))


def test_batch_tensors_and_lane():
    a = torch.zeros(2, dtype=torch.long)
    b = torch.zeros(2, requires_grad=True)
    batch = Batch((a, 1, b))
    assert batch.tensors == [a, b]
    assert batch.tensor is b  # the lane is the first tensor that requires grad
    c = torch.ones(2)
    batch.tensor = c
    assert batch.value[2] is c and batch.value[1] == 1


def test_with_tensors_leaves_original_alone():
    x = torch.zeros(2)
    batch = Batch((x, "k"))
    other = batch.with_tensors([torch.ones(2)])
    assert batch.value[0] is x
    assert torch.equal(other.value[0], torch.ones(2)) and other.value[1] == "k"


def test_replace_tensors_checks_count():
    with pytest.raises(ValueError, match="expected 1 tensors, got 2"):
        Batch(torch.zeros(1)).replace_tensors([torch.zeros(1), torch.zeros(1)])


def test_value_without_tensor_has_no_lane():
    with pytest.raises(TypeError, match="holds no tensor"):
        Batch((1, 2)).tensor


def test_scatter_errors():
    with pytest.raises(TypeError, match="0-dim tensor"):
        scatter(torch.tensor(1.0), 2)
    with pytest.raises(ValueError, match="batch size 0"):
        scatter(torch.zeros(0, 3), 2)


def test_gather_keeps_a_non_tensor_that_every_microbatch_agrees_on():
    batches = [Batch((torch.full((2,), float(i)), 0.5, None, [1, "a"])) for i in range(3)]
    out = gather(batches)
    assert out[1:] == (0.5, None, [1, "a"])


def test_gather_rejects_a_non_tensor_that_differs_between_microbatches():
    # The plain module would return one value for the whole batch; no micro-batch's value is it.
    batches = [Batch((torch.zeros(2), i)) for i in range(3)]
    with pytest.raises(ValueError, match=r"\(0 in micro-batch 0, 1 in micro-batch 1, at position 1 of .*"
                                         r"return it as a tensor with a batch dimension"):
        gather(batches)
