"""The skip layout: routes from stash partition to pop partition."""
from __future__ import annotations

from torch import nn

from models import PopLinear, StashLinear
from pipe.skip import Namespace
from pipe.skip.layout import inspect_skip_layout


def test_routes_and_arriving() -> None:
    ns = Namespace()
    partitions = [
        nn.Sequential(StashLinear(2), StashLinear(2).isolate(ns)),
        nn.Sequential(nn.Linear(2, 2)),
        nn.Sequential(PopLinear(2).isolate(ns), StashLinear(2).isolate(Namespace())),
    ]
    partitions[2][1].isolate(ns2 := Namespace())
    partitions.append(nn.Sequential(PopLinear(2).isolate(ns2), PopLinear(2)))
    layout = inspect_skip_layout(partitions)
    assert layout.routes == {(None, "skip"): (0, 3), (ns, "skip"): (0, 2), (ns2, "skip"): (2, 3)}
    assert layout.arriving(3) == [(0, None, "skip"), (2, ns2, "skip")] or \
        layout.arriving(3) == [(2, ns2, "skip"), (0, None, "skip")]
    assert layout.arriving(1) == [] and layout.arriving(2) == [(0, ns, "skip")]
    assert layout.crosses_partitions(ns2, "skip")


def test_skip_inside_one_partition_needs_no_portal() -> None:
    layout = inspect_skip_layout([nn.Sequential(StashLinear(2), PopLinear(2))])
    assert layout and not layout.crosses_partitions(None, "skip")
    assert layout.arriving(0) == []


def test_no_skips_is_falsy() -> None:
    assert not inspect_skip_layout([nn.Sequential(nn.Linear(2, 2))])
