"""DCP checkpoints across (pipeline, shard) layouts: saved at (2, 2), resumed at (4, 1) and (1, 4), bit for bit.

``state.save`` writes each rank's FSDP2 shards (DTensors) under the plain
model's keys, and DCP reads whatever part a rank of another layout holds. The
check is bitwise: an uninterrupted run at (pp 2, dp_shard 2) against runs
resumed from its checkpoint at (pp 4) and (pp 1, dp_shard 4). To make the
layouts comparable to the last bit, every data-parallel rank takes the same
batch, so averaging gradients over 1, 2 or 4 ranks is exact (x + x = 2x, and
halving is exact); micro-batches, stages' arithmetic and AdamW are then the
same in every layout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from decoder import decoder, lm_data, lm_loss
from pipe.distributed import DistributedPipe, Shard, make_mesh, state
from spawn_ranks import run_ranks

LAYOUTS = {(2, 2): "saved", (4, 1): "resumed", (1, 4): "resumed"}


def _build(pp: int, shard: int, seed: int) -> tuple[DistributedPipe, torch.optim.Optimizer]:
    mesh = make_mesh(pp=pp, dp_shard=shard)
    piped = DistributedPipe(decoder(seed, blocks=2), chunks=2, checkpoint="except_last", schedule="1f1b",
                            mesh=mesh, shard=Shard() if shard > 1 else None)
    return piped, torch.optim.AdamW(piped.parameters(), lr=0.01)


def _train(piped: DistributedPipe, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = lm_data(step)  # the same batch on every data-parallel rank (see the module docstring)
        loss = piped.step(x, y, lm_loss, broadcast_loss=True)
        optimizer.step()
        optimizer.zero_grad()
        assert loss is not None
        losses.append(loss.item())
    return losses


def _weights(piped: DistributedPipe) -> dict[str, list[float]]:
    """This rank's parameters, gathered to full tensors (plain lists: compared across processes)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
            for name, p in piped.named_parameters()}


def _layouts(rank: int, world: int, folder: str) -> dict[str, Any]:
    path = str(Path(folder) / "checkpoint")
    piped, optimizer = _build(2, 2, seed=0)
    _train(piped, optimizer, range(2))
    state.save(path, piped, optimizer, step=2)
    results = {"(2, 2)": (_train(piped, optimizer, range(2, 4)), _weights(piped))}
    for pp, shard in (layout for layout, role in LAYOUTS.items() if role == "resumed"):
        resumed, resumed_optimizer = _build(pp, shard, seed=1)  # other initial weights: the load must replace them
        assert state.load(path, resumed, resumed_optimizer) == {"step": 2}
        results[f"({pp}, {shard})"] = (_train(resumed, resumed_optimizer, range(2, 4)), _weights(resumed))
    return results


def test_sharded_checkpoint_resumes_bit_for_bit_at_other_layouts(tmp_path: Path) -> None:
    per_rank = run_ranks(_layouts, 4, str(tmp_path), deadline=180)
    reference_losses = per_rank[0]["(2, 2)"][0]
    reference_weights: dict[str, list[float]] = {}
    for result in per_rank:
        reference_weights.update(result["(2, 2)"][1])
    assert len(reference_weights) == len(dict(decoder(0).named_parameters()))
    for layout in ("(4, 1)", "(1, 4)"):
        for rank, result in enumerate(per_rank):
            losses, weights = result[layout]
            assert losses == reference_losses, (layout, rank, losses, reference_losses)  # exactly
            for name, values in weights.items():
                assert values == reference_weights[name], f"{layout} rank {rank}: {name} differs after 2 steps"
    # Each rank wrote its own shards, under the plain model's keys: the plain module in this
    # process reads them and continues the same curve (one batch, not micro-batches: close, not exact).
    assert len(list((tmp_path / "checkpoint").glob("*.distcp"))) == 4
    plain = decoder(2, blocks=2)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    assert state.load_module(tmp_path / "checkpoint", plain, optimizer) == {"step": 2}
    losses = []
    for step in range(2, 4):
        x, y = lm_data(step)
        loss = lm_loss(plain(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(losses, reference_losses, rtol=1e-5, atol=1e-6)
