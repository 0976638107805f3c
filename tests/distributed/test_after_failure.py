"""After a caught PipelineFailure: the next step fails at once saying the pipeline is broken and how to
recover, and a DistributedPipe rebuilt on every rank trains like the plain model again."""
from __future__ import annotations

import datetime

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dist_models import WIDTH, check_against_oracle
from pipe.distributed import DistributedPipe, PipelineFailure
from spawn_ranks import run_ranks


class RaisesOnce(nn.Module):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.at, self.calls = at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("boom in layer 2")
        return self.linear(x)


def _model(at: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), RaisesOnce(at), nn.Tanh())


def _caught_then_rebuilt(rank: int, world: int) -> dict[str, str]:
    pipe = DistributedPipe(_model(3), chunks=2, checkpoint="never")  # layer 2 (rank 1) raises in step 1
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    pipe.step(x, y, F.mse_loss)
    pipe._runtime.transport.timeout = datetime.timedelta(seconds=1)  # rank 0 gives up on rank 1 after 1 s
    pipe._runtime.failures.timeout = 1.0
    seen: dict[str, str] = {}
    try:
        pipe.step(x, y, F.mse_loss)
        seen["failure"] = "no error"
    except (ValueError, PipelineFailure) as error:  # rank 1: its own ValueError; rank 0: PipelineFailure
        seen["failure"] = f"{type(error).__name__}: {error}"
    # At once: the next step raises before it runs anything of its program or sends or receives a message (a
    # wait on a peer would); checked by what it called, not by how long it took, which a busy machine lengthens.
    runtime, used = pipe._runtime, []
    for owner, name in ((runtime, "lowered"), (runtime.transport, "send"), (runtime.transport, "receive"),
                        (runtime.transport, "flush")):
        setattr(owner, name, (lambda real, name: lambda *a, **k: used.append(name) or real(*a, **k))(
            getattr(owner, name), name))
    try:
        pipe.step(x, y, F.mse_loss)
        seen["next"] = "no error"
    except PipelineFailure as error:
        seen["next"] = str(error)
    seen["next_used"] = ", ".join(used) or "nothing"
    # The recovery the message names: a new DistributedPipe on every rank trains like the plain model.
    model = _model(0)
    rebuilt = DistributedPipe(model, chunks=2, checkpoint="never")
    for _ in range(2):
        rebuilt.zero_grad()
        loss = rebuilt.step(x, y, F.mse_loss)
        check_against_oracle(rebuilt, model, x, y, loss, f"rank {rank} rebuilt")
    seen["rebuilt"] = "trains"
    return seen


def test_a_broken_pipeline_says_so_and_a_rebuilt_one_trains() -> None:
    zero, one = run_ranks(_caught_then_rebuilt, 2)
    assert one["failure"].startswith("ValueError: boom in layer 2"), one
    assert zero["failure"].startswith("PipelineFailure: rank 0 stopped in") and \
        "because rank 1 failed in F0@1: ValueError: boom in layer 2" in zero["failure"], zero
    for seen in (zero, one):
        assert seen["next"].startswith("this DistributedPipe is broken: step 2 failed ("), seen
        assert "build a new DistributedPipe on every rank" in seen["next"] and "restart the job" in seen["next"]
        assert seen["next_used"] == "nothing", seen  # at once, no wait on a peer
        assert seen["rebuilt"] == "trains"
