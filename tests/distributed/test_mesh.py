"""The topology as a DeviceMesh: layout, groups, and the errors of a mesh that does not fit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
    out["sharded"] = model.shard == pd.Shard()  # the default with a dp_shard dimension
    # data_parallel=N builds ("pp", "dp_replicate") with the old layout: consecutive ranks form a pipeline.
    replicas = pd.DistributedPipe(_linears(), chunks=2, data_parallel=2)
    out["replica_mesh"] = (replicas.mesh.mesh_dim_names, replicas.mesh.mesh.tolist())
    out["replica_place"] = (replicas.topology.pipeline_rank, replicas.topology.replica)
    # Errors, every one raised on every rank before anything collective can hang.
    errors = {
        "size": lambda: pd.make_mesh(pp=3),
        "no pp": lambda: pd.DistributedPipe(_linears(), mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))),
        "unknown": lambda: pd.DistributedPipe(_linears(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "data"))),
        "not a mesh": lambda: pd.DistributedPipe(_linears(), mesh="pp=2"),  # type: ignore[arg-type]
        "disagrees": lambda: pd.DistributedPipe(_linears(), mesh=mesh, data_parallel=4),
        "shard without dp_shard": lambda: pd.DistributedPipe(_linears(), data_parallel=2, shard=pd.Shard()),
        "schedule": lambda: pd.DistributedPipe(_linears(), chunks=3, mesh=mesh, schedule="interleaved",
                                               virtual_stages=2),
    }
    wrapped = _linears()
    fully_shard(wrapped[0], mesh=mesh["dp_shard"])
    errors["already sharded"] = lambda: pd.DistributedPipe(wrapped, chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2))
    out.update({name: _error(fn) for name, fn in errors.items()})
    dist.barrier()
    return out


def test_mesh_layout_groups_and_errors() -> None:
    results = run_ranks(_layouts_and_errors, 4, deadline=120.0)
    assert [r["names"] for r in results] == [("pp", "dp_shard")] * 4
    # make_mesh puts pp outermost (torchtitan's order): ranks 0, 1 are pipeline rank 0, shards 0 and 1.
    assert [r["place"] for r in results] == [(0, 0, 0, 2, [0]), (0, 1, 1, 2, [0]), (1, 0, 0, 2, [1]), (1, 1, 1, 2, [1])]
    assert [r["pipeline"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["mesh_is_kept"] and r["sharded"] for r in results)
    assert results[0]["replica_mesh"] == (("pp", "dp_replicate"), [[0, 2], [1, 3]])
    assert [r["replica_place"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    first = results[0]
    assert "pp 3 = 3 ranks, but the world has 4" in first["size"]
    assert "no 'pp' (pipeline) dimension" in first["no pp"]
    assert "['data']" in first["unknown"] and "dp_shard" in first["unknown"]
    assert first["not a mesh"].startswith("TypeError") and "make_mesh" in first["not a mesh"]
    assert "data_parallel=4 disagrees with the mesh" in first["disagrees"] and "hold 2" in first["disagrees"]
    assert "needs a mesh with a 'dp_shard' dimension" in first["shard without dp_shard"]
    assert "chunks divisible by the pipeline ranks" in first["schedule"]
    assert all("module '0' of the model is already wrapped with fully_shard" in r["already sharded"] for r in results)


def _sharded_step(rank: int, world: int) -> list[str]:
    """(pp 2, dp_shard 2), ZeRO-3 and ZeRO-2: loss and full gradients are the plain model's on the global batch."""
    checked = []
    for raf in (True, False):
        plain = _linears()
        model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, schedule="1f1b",
                                   mesh=pd.make_mesh(pp=2, dp_shard=2), shard=pd.Shard(reshard_after_forward=raf))
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
        checked.append(f"raf={raf}")
    return checked


@pytest.mark.timeout(150)
def test_sharded_stages_match_the_plain_model() -> None:
    assert run_ranks(_sharded_step, 4, deadline=120.0) == [["raf=True", "raf=False"]] * 4
