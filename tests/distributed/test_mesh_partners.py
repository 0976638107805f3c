"""What a mesh's partners must share, checked at start, and uneven data-parallel shares made exact (4 gloo ranks).

- Every group of the mesh gets the job's timeout (torch's default is 30 minutes).
- A mesh of another device type than the rank's is refused naming both.
- Shard, replica and tensor-parallel partners holding other parameter shapes,
  or other initial values (another seed), are refused naming the first
  parameter that differs, on every rank, before any collective of FSDP.
- A global batch of 7 split 4/3 over two shards (FSDP) or two replicas: the
  loss and every gradient are the plain model's on the 7 rows.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import pipe.distributed as pd
from spawn_ranks import run_ranks

WIDTH, TIMEOUT = 8, 20.0


class Mix(nn.Module):
    def __init__(self, hidden: int = 2 * WIDTH) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def model(seed: int = 0, hidden: int = 2 * WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Mix(), Mix(), Mix(hidden), Mix())


def _refused(build: object) -> str:
    try:
        build()  # type: ignore[operator]
    except ValueError as error:
        return str(error)
    return "accepted"


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[attr-defined]


def _uneven(rank: int, mesh_kind: str) -> tuple[float, float, float]:
    """``(loss, plain loss, greatest gradient difference)`` for 7 rows split 4/3 over the data-parallel ranks."""
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, WIDTH, generator=generator), torch.randn(7, WIDTH, generator=generator)
    plain = model()
    plain_loss = F.mse_loss(plain(x), y)
    plain_loss.backward()
    if mesh_kind == "fsdp":
        piped = pd.DistributedPipe(model(), chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2))
    else:
        piped = pd.DistributedPipe(model(), chunks=2, mesh=pd.make_mesh(pp=2, dp_replicate=2))
    rows = slice(0, 4) if piped.topology.replica == 0 else slice(4, 7)
    loss = piped.step(x[rows], y[rows], F.mse_loss, broadcast_loss=True)
    assert loss is not None
    worst = 0.0
    plain_grads = dict(plain.named_parameters())
    for name, param in piped.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        worst = max(worst, float((grad - plain_grads[name].grad).abs().max()))
    return float(loss), float(plain_loss), worst


def _partners(rank: int, world: int) -> dict[str, object]:
    found: dict[str, object] = {}
    world_timeout = _timeout(dist.group.WORLD)  # type: ignore[arg-type]
    mesh = pd.make_mesh(pp=1, dp_replicate=2, dp_shard=2)
    pd.DistributedPipe(model(), chunks=2, mesh=mesh)
    found["timeouts"] = sorted({_timeout(g) == world_timeout for g in mesh.get_all_groups()})
    found["meta"] = _refused(lambda: pd.DistributedPipe(model(), chunks=2, mesh=DeviceMesh(
        "meta", torch.arange(4).reshape(2, 2), mesh_dim_names=("pp", "dp_shard"))))
    found["shapes"] = _refused(lambda: pd.DistributedPipe(
        model(hidden=3 * WIDTH if rank == 3 else 2 * WIDTH), chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2)))
    found["seeds"] = _refused(lambda: pd.DistributedPipe(
        model(seed=1 if rank == 3 else 0), chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2)))
    # A mesh of the user's own layout: each pipeline on consecutive ranks ({0, 1} and {2, 3}).
    consecutive = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).t(), mesh_dim_names=("pp", "dp_replicate"))
    found["replica seeds"] = _refused(lambda: pd.DistributedPipe(
        model(seed=1 if rank == 3 else 0), chunks=2, mesh=consecutive))
    found["uneven fsdp"] = _uneven(rank, "fsdp")
    found["uneven replicas"] = _uneven(rank, "replicas")
    return found


def test_mesh_partners_are_checked_at_start_and_uneven_shares_are_exact() -> None:
    results = run_ranks(_partners, 4, timeout=TIMEOUT, deadline=150)
    for rank, found in enumerate(results):
        assert found["timeouts"] == [True], (rank, found["timeouts"])  # every mesh group: the job's timeout
        meta = found["meta"]
        assert "device type is 'meta'" in meta and "cpu" in meta, meta
        # Stage 1 (layers 2 and 3) differs on rank 3; ranks 2 and 3 hold it (pipeline rank 1); ranks 0, 1 also
        # refuse (every rank compares the same lists), naming the same parameter.
        shapes = found["shapes"]
        assert "ranks 2 and 3" in shapes and "'2.up.weight' differs" in shapes and "(24, 8)" in shapes, shapes
        seeds = found["seeds"]
        assert "ranks 2 and 3" in seeds and "'2.up.weight' starts with other values" in seeds, seeds
        assert "torch.manual_seed" in seeds, seeds
        # The consecutive layout: pipelines {0, 1} and {2, 3}; rank 3 is pipeline rank 1 with rank 1.
        replica_seeds = found["replica seeds"]
        assert "ranks 1 and 3" in replica_seeds and "'2.up.weight' starts with other values" in replica_seeds, \
            replica_seeds
        for kind in ("uneven fsdp", "uneven replicas"):
            loss, plain_loss, worst = found[kind]  # type: ignore[misc]
            assert abs(loss - plain_loss) < 1e-6, (kind, rank, loss, plain_loss)
            assert worst < 1e-6, (kind, rank, worst)
