"""Configuration checks at start: ranks that disagree, or a world that does not fit, fail at once."""
from __future__ import annotations

import pytest

from dist_models import blocks
from pipe.distributed import DistributedPipe, make_mesh
from spawn_ranks import run_ranks


def _mismatches(rank: int, world: int) -> list[str]:
    messages = []
    cases = [
        lambda: DistributedPipe(blocks(8), chunks=4 if rank == 0 else 3),  # ranks disagree
        lambda: DistributedPipe(blocks(8), chunks=4, balance=[4, 4] if rank == 0 else [5, 3]),  # ranks disagree
        lambda: DistributedPipe(blocks(8), chunks=4, mesh=make_mesh(pp=1, dp_replicate=3)),  # world 2 is not 3
        lambda: DistributedPipe(blocks(8), chunks=4, balance=[3, 3, 2]),  # 3 stages for 2 ranks
        lambda: DistributedPipe(blocks(8), chunks=3, schedule="interleaved", virtual_stages=2),  # 3 over 2 ranks
    ]
    for case in cases:
        with pytest.raises(ValueError) as info:
            case()
        messages.append(str(info.value))
    # After all that, a good configuration still builds and trains.
    DistributedPipe(blocks(8), chunks=2)
    return messages


def test_mismatched_configuration_fails_on_every_rank_at_start() -> None:
    for messages in run_ranks(_mismatches, 2):
        chunks, balance, replicas, stages, interleaved = messages
        assert "ranks disagree on chunks (rank 0: 4, rank 1: 3)" in chunks
        assert "ranks disagree on balance (rank 0: [4, 4], rank 1: [5, 3])" in balance
        assert "make_mesh: pp 1 x dp_replicate 3 = 3 ranks, but the world has 2; choose sizes whose product is 2" \
            in replicas, replicas
        assert "balance [3, 3, 2] has 3 stages but the schedule has 2" in stages
        # Worded in DistributedPipe's arguments (chunks), not pipe.core.schedule's (microbatches).
        assert "schedule='interleaved' needs chunks divisible by the pipeline ranks (got chunks=3, 2 " \
               "pipeline ranks)" in interleaved and "use chunks=2 or chunks=4" in interleaved, interleaved
        assert "microbatches" not in interleaved, interleaved
