"""Stages per rank: only owned layers are built or allocated; names are the original module's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipe

from pipe.distributed.stage import build_stages, even_balance, layer_count
from pipe.core.schedule import Schedule


def test_even_balance() -> None:
    assert even_balance(8, 3) == [3, 3, 2]
    assert even_balance(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="the model has 2 layers but the pipeline has 3 stages"):
        even_balance(2, 3)


def test_a_split_model_with_too_few_pieces_is_told_to_add_cut_points() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    stages = pipe.split(model, (torch.randn(2, 4),), at=["2"])  # 2 pieces
    zbv = Schedule("zbv", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"the model has 2 pieces \(pipe.split with 1 cut point\) but the pipeline "
                                         r"has 4 stages \(2 pipeline ranks x 2 stages per rank, in a V\); every "
                                         r"stage needs a piece: give pipe.split at least 3 cut points \(at="):
        even_balance(len(stages), zbv.stages, stages, zbv)
    interleaved = Schedule("interleaved", ranks=2, microbatches=2, virtual_stages=3)
    with pytest.raises(ValueError, match=r"has 6 stages \(2 pipeline ranks x 3 stages per rank\).* at least 5 cut"):
        even_balance(len(stages), interleaved.stages, stages, interleaved)


def test_layer_count_errors() -> None:
    assert layer_count(nn.Sequential(nn.ReLU(), nn.ReLU()), None) == 2
    with pytest.raises(ValueError, match="a layer factory needs layers="):
        layer_count(lambda i: nn.ReLU(), None)
    with pytest.raises(TypeError, match="must be an nn.Sequential or a layer factory"):
        layer_count(nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="layers=3 but the nn.Sequential has 2"):
        layer_count(nn.Sequential(nn.ReLU(), nn.ReLU()), 3)


def test_factory_builds_only_owned_layers() -> None:
    built: list[int] = []

    def factory(index: int) -> nn.Module:
        if torch.empty(0).device.type != "meta":
            built.append(index)
        return nn.Linear(3, 3)

    schedule = Schedule("interleaved", ranks=2, microbatches=2, virtual_stages=2)
    owned, skeleton = build_stages(factory, 8, [2, 2, 2, 2], schedule, rank=1, device=torch.device("cpu"))
    assert sorted(owned) == [1, 3]  # stage s on rank s % 2
    assert built == [2, 3, 6, 7]
    assert [list(owned[s]._modules) for s in (1, 3)] == [["2", "3"], ["6", "7"]]
    assert all(p.device.type == "meta" for p in skeleton[0].parameters())
    assert all(p.device.type == "cpu" for p in owned[1].parameters())


def test_meta_sequential_is_allocated_and_reset_only_where_owned() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 2))
    schedule = Schedule("1f1b", ranks=2, microbatches=2)
    owned, _ = build_stages(model, 4, [2, 2], schedule, rank=0, device=torch.device("cpu"))
    assert list(owned) == [0]
    weight = owned[0][0].weight
    assert weight.device.type == "cpu" and torch.isfinite(weight).all() and weight.abs().sum() > 0
    assert model[3].weight.is_meta  # not owned: still costs nothing


def test_balance_must_match_stages() -> None:
    schedule = Schedule("gpipe", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"balance \[1, 1, 1\] has 3 stages but the schedule has 2"):
        build_stages(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU()), 3, [1, 1, 1], schedule, 0, torch.device("cpu"))
