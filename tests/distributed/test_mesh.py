"""The topology as a DeviceMesh: layout, groups, and the errors of a mesh that does not fit."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import pipe.distributed as pd
from spawn_ranks import run_ranks


def _linears(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(layers)])


def _error(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _layouts_and_errors(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    mesh = pd.make_mesh(pp=2, dp_shard=2)
    out["names"] = mesh.mesh_dim_names
    model = pd.DistributedPipe(_linears(), chunks=2, mesh=mesh)
    top = model.topology
    out["place"] = (top.pipeline_rank, top.replica, top.pipeline, top.data_parallel, model.stages)
    out["pipeline"] = [top.global_rank(p) for p in range(top.ranks)]
    out["mesh_is_kept"] = model.mesh is mesh
    # The default with a dp_shard dimension, its unit chosen for the schedule (1F1B: a block at a time).
    out["sharded"] = model.shard == pd.Shard(unit="block")
    # Replicas are the mesh's "dp_replicate" dimension, pp outermost: each stage's replicas on consecutive ranks.
    replicated = pd.make_mesh(pp=2, dp_replicate=2)
    replicas = pd.DistributedPipe(_linears(), chunks=2, mesh=replicated)
    out["replica_mesh"] = (replicas.mesh.mesh_dim_names, replicas.mesh.mesh.tolist())
    out["replica_place"] = (replicas.topology.pipeline_rank, replicas.topology.replica)
    # No mesh: one pipeline over the world.
    alone = pd.DistributedPipe(_linears(), chunks=2)
    out["default_mesh"] = (alone.mesh.mesh_dim_names, alone.mesh.mesh.tolist(), alone.stages)
    # Errors, every one raised on every rank before anything collective can hang.
    errors = {
        "size": lambda: pd.make_mesh(pp=3),
        "no pp": lambda: pd.DistributedPipe(_linears(), mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))),
        "unknown": lambda: pd.DistributedPipe(_linears(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "data"))),
        "not a mesh": lambda: pd.DistributedPipe(_linears(), mesh="pp=2"),  # type: ignore[arg-type]
        "shard without dp_shard": lambda: pd.DistributedPipe(_linears(), mesh=replicated, shard=pd.Shard()),
        "schedule": lambda: pd.DistributedPipe(_linears(), chunks=3, mesh=mesh, schedule="interleaved",
                                               virtual_stages=2),
    }
    wrapped = _linears()
    fully_shard(wrapped[0], mesh=mesh["dp_shard"])
    errors["already sharded"] = lambda: pd.DistributedPipe(wrapped, chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2))
    out.update({name: _error(fn) for name, fn in errors.items()})
    with pytest.warns(UserWarning, match="tp=2 but neither tensor_parallel= nor parallelize= was given"):
        tp = pd.DistributedPipe(_linears(), chunks=2, mesh=pd.make_mesh(pp=2, tp=2))
    out["tp place"] = (tp.topology.pipeline_rank, tp.topology.coordinate("tp"), tp.topology.data_parallel)
    dist.barrier()
    return out


def test_mesh_layout_groups_and_errors() -> None:
    results = run_ranks(_layouts_and_errors, 4, deadline=120.0)
    assert [r["names"] for r in results] == [("pp", "dp_shard")] * 4
    # make_mesh puts pp outermost (torchtitan's order): ranks 0, 1 are pipeline rank 0, shards 0 and 1.
    assert [r["place"] for r in results] == [(0, 0, 0, 2, [0]), (0, 1, 1, 2, [0]), (1, 0, 0, 2, [1]), (1, 1, 1, 2, [1])]
    assert [r["pipeline"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["mesh_is_kept"] and r["sharded"] for r in results)
    # Ranks differing only in "tp" see the same data: one data part.
    assert [r["tp place"] for r in results] == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert results[0]["replica_mesh"] == (("pp", "dp_replicate"), [[0, 1], [2, 3]])
    assert [r["replica_place"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["default_mesh"] for r in results] == [(("pp",), [0, 1, 2, 3], [rank]) for rank in range(4)]
    first = results[0]
    assert "pp 3 = 3 ranks, but the world has 4" in first["size"]
    assert "no 'pp' (pipeline) dimension" in first["no pp"]
    assert "['data']" in first["unknown"] and "dp_shard" in first["unknown"]
    assert first["not a mesh"].startswith("TypeError") and "make_mesh" in first["not a mesh"]
    assert "needs a mesh with a 'dp_shard' dimension" in first["shard without dp_shard"]
    assert "chunks divisible by the pipeline ranks" in first["schedule"]
    assert all("module '0' of the model is already wrapped with fully_shard" in r["already sharded"] for r in results)


def _sharded_step(rank: int, world: int) -> list[str]:
    """(pp 2, dp_shard 2), ZeRO-3 and ZeRO-2: loss and full gradients are the plain model's on the global batch."""
    checked = []
    for raf in (True, False):
        plain = _linears()
        # ZeRO-2 with a policy: each Linear inside the layers gets its own fully_shard.
        blocks = None if raf else (lambda name, module: isinstance(module, nn.Linear))
        model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, schedule="1f1b", mesh=pd.make_mesh(pp=2, dp_shard=2),
                                   shard=pd.Shard(reshard_after_forward=raf, blocks=blocks))
        wrapped = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert wrapped == ([str(2 * model.stages[0]), str(2 * model.stages[0] + 1)] if raf
                           else [f"{2 * model.stages[0] + k}.0" for k in (0, 1)]), wrapped
        torch.manual_seed(1)
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        rows = slice(model.topology.replica * 4, model.topology.replica * 4 + 4)
        loss = model.step(x[rows], y[rows], F.mse_loss, broadcast_loss=True)
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        assert loss is not None and torch.allclose(loss, expected.detach(), atol=1e-6), (loss, expected)
        grads = dict(plain.named_parameters())
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            full = param.grad.full_tensor()  # type: ignore[attr-defined]
            torch.testing.assert_close(full, grads[name].grad, atol=1e-6, rtol=1e-5)
        # Between steps every stage holds only its shards: parameters and gradients are half-size DTensors.
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.to_local().numel() * 2 == param.numel(), name
            assert isinstance(param.grad, DTensor) and param.grad.to_local().numel() * 2 == param.numel(), name
        checked.append(f"raf={raf}")
    return checked


@pytest.mark.timeout(150)
def test_sharded_stages_match_the_plain_model() -> None:
    assert run_ranks(_sharded_step, 4, deadline=120.0) == [["raf=True", "raf=False"]] * 4


def _events(kind: str, rank: int, zero3: bool, virtual: int = 2) -> list[str]:
    """The FSDP steps of the rank's lowered program around its compute actions."""
    from pipe.core.lowering import COMPUTE, Kind, Routes, lower
    from pipe.core.schedule import Schedule

    schedule = Schedule(kind, 2, 2, virtual)
    names = {Kind.UNSHARD: "gather", Kind.REDUCE_GRAD: "reduce", Kind.RESHARD: "reshard"}
    return [str(step) if step.kind in COMPUTE else f"{names[step.kind]} {step.stage}"
            for step in lower(schedule.actions(rank), Routes.chain(schedule.stages), zero3=zero3)
            if step.kind in COMPUTE or step.kind in names]


def test_the_runner_gathers_ahead_and_reduces_each_stage_once_after_its_last_backward() -> None:
    # Looped BFS, rank 0 (stages 0 and 2), ZeRO-2: both gathered before use (stage 2 prefetched during
    # stage 0's last forward), stage 2 reduced and freed as soon as its backwards are done.
    assert _events("looped-bfs", 0, zero3=False) == [
        "gather 0", "F0@0", "gather 2", "F1@0", "F0@2", "F1@2", "B1@2", "B0@2", "reduce 2", "reshard 2",
        "B1@0", "B0@0", "reduce 0", "reshard 0"]
    # ZeRO-3: stage 0 is freed while stage 2 runs, and gathered again (prefetched) for its backwards.
    assert _events("looped-bfs", 0, zero3=True) == [
        "gather 0", "F0@0", "gather 2", "F1@0", "reshard 0", "F0@2", "F1@2", "B1@2", "gather 0", "B0@2",
        "reduce 2", "reshard 2", "B1@0", "B0@0", "reduce 0", "reshard 0"]
    # Zero bubble: the reduction waits for the stage's last W, not its last I.
    events = _events("zbv", 1, zero3=False)
    last_weight = max(i for i, e in enumerate(events) if e.startswith("W") and e.endswith("@1"))
    assert events.index("reduce 1") == last_weight + 1
    assert sum(e.startswith("reduce") for e in events) == 2 and sum(e.startswith("gather") for e in events) == 2


@pytest.mark.parametrize("arguments, error, message", [
    ({"unit": "layer"}, ValueError,
     "Shard(unit=...) must be one of ('stage', 'block') or None (the default), got 'layer'"),
    ({"reduce": "always"}, ValueError, "Shard(reduce=...) must be one of ('step', 'micro-batch'), got 'always'"),
    ({"unit": "stage", "reduce": "micro-batch"}, ValueError,
     "Shard(reduce='micro-batch') needs unit='block' (got unit='stage')"),
    ({"reshard_after_forward": False, "reduce": "micro-batch"}, ValueError,
     "Shard(reduce='micro-batch') needs unit='block' (got unit='stage', ZeRO-2's)"),
    ({"unit": "block", "reshard_after_forward": False}, ValueError,
     "Shard(unit='block', reshard_after_forward=False): ZeRO-2 keeps a stage gathered"),
    ({"unit": "stage", "reshard_after_backward": False}, ValueError,
     "Shard(reshard_after_backward=False) goes with unit='block' and reduce='step' (got unit='stage'"),
    ({"unit": "block", "reduce": "micro-batch", "reshard_after_backward": False}, ValueError,
     "Shard(reshard_after_backward=False) goes with unit='block' and reduce='step' (got unit='block', "
     "reduce='micro-batch')"),
    ({"reshard_after_backward": 0}, TypeError, "Shard(reshard_after_backward=...) must be True or False, got 0"),
    ({"unit": "stage", "prefetch": False}, ValueError, "Shard(prefetch=False) goes with unit='block' (got unit='stage')"),
    ({"reshard_after_forward": False, "prefetch": False}, ValueError,
     "Shard(prefetch=False) goes with unit='block' (got unit='stage', ZeRO-2's)"),
    ({"unit": "block", "prefetch": "no"}, TypeError, "Shard(prefetch=...) must be True or False, got 'no'"),
])
def test_a_bad_unit_or_reduce_is_refused_naming_the_value_and_the_fix(arguments: dict[str, Any], error: type,
                                                                       message: str) -> None:
    with pytest.raises(error) as raised:
        pd.Shard(**arguments)
    assert str(raised.value).startswith(message), raised.value
    assert any(fix in str(raised.value) for fix in ("pass", "must be one of", "must be True or False"))


def test_the_default_unit_is_a_block_under_zero3_where_the_schedule_allows_it() -> None:
    """Shard() leaves the unit to DistributedPipe: a block at a time under ZeRO-3 when the schedule's backward is
    whole; a stage whole under ZeRO-2 and with a schedule that splits the backward (zero bubble)."""
    assert pd.Shard().unit is None
    assert pd.Shard().with_unit("1f1b", splits_backward=False).unit == "block"
    assert pd.Shard().with_unit("zbv", splits_backward=True).unit == "stage"
    assert pd.Shard(reshard_after_forward=False).with_unit("1f1b", splits_backward=False).unit == "stage"
    assert pd.Shard(unit="stage").with_unit("1f1b", splits_backward=False).unit == "stage"
    assert pd.Shard(prefetch=False).with_unit("gpipe", splits_backward=False).unit == "block"
    for needs_block in (pd.Shard(unit="block"), pd.Shard(reduce="micro-batch"), pd.Shard(prefetch=False),
                        pd.Shard(reshard_after_backward=False)):
        with pytest.raises(ValueError, match=r"^shard=Shard\(unit='block'\) with schedule 'zbv', which splits each "
                                             r"backward.*use Shard\(unit='stage'\) with this schedule"):
            needs_block.with_unit("zbv", splits_backward=True)
