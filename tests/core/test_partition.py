"""Cutting an nn.Sequential into partitions."""
import pytest
import torch
from torch import nn

from pipe.core.partition import default_devices, split_module, verify_module


def test_split_by_balance_keeps_names():
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1))
    partitions, balance, devices = split_module(model, [2, 1], ["cpu", "cpu"])
    assert balance == [2, 1] and devices == [torch.device("cpu")] * 2
    assert list(partitions[0]._modules) == ["0", "1"] and list(partitions[1]._modules) == ["2"]


def test_split_by_placement_groups_consecutive_layers():
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1).to("meta"), nn.ReLU(), nn.Linear(1, 1))
    _, balance, devices = split_module(model)
    assert balance == [2, 2, 1]
    assert [d.type for d in devices] == ["cpu", "meta", "cpu"]


def test_device_spellings():
    from pipe.core.partition import _normalize_device

    assert _normalize_device(1) == torch.device("cuda", 1)
    assert _normalize_device("cpu") == torch.device("cpu")
    assert _normalize_device(torch.device("cuda", 2)) == torch.device("cuda", 2)


def test_default_devices_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert default_devices(3) == [torch.device("cpu")] * 3


def test_verify_module_rejects_none_layer():
    model = nn.Sequential(nn.ReLU())
    model._modules["1"] = None
    with pytest.raises(TypeError, match="layer '1' of the module is None"):
        verify_module(model)
