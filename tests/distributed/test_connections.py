"""The connections of pipe's groups: a shut-down connection ends the waits on it at both ends, and gloo's error
leads to the rank at the other end (pipe.distributed.connections)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from pipe.distributed import connections
from spawn_ranks import hold_the_store, run_ranks


def _released_by_shutdown(rank: int, world: int) -> dict[str, object]:
    group = connections.recording(lambda: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60)), "pipeline")
    store = dist.distributed_c10d._get_default_store()
    seen: dict[str, object] = {}
    buffer = torch.zeros(4)
    work = group.recv([buffer], 1 - rank, 7)  # both ranks wait for a message that never comes (60 s timeout)
    store.set(f"posted/{rank}", "yes")
    if rank == 1:
        store.wait(["posted/0", "posted/1"], datetime.timedelta(seconds=30))
        seen["shut down"] = connections.abort("pipeline")
        seen["again"] = connections.abort("pipeline")  # forgotten once shut down
    try:
        work.wait(datetime.timedelta(seconds=60))
        seen["error"] = "no error"
    except RuntimeError as error:
        seen["error"] = str(error)
        seen["peer"] = connections.rank_at(error)
    hold_the_store(rank, world)
    return seen


def test_a_shut_down_connection_ends_the_waits_at_both_ends_and_names_the_other_rank() -> None:
    zero, one = run_ranks(_released_by_shutdown, 2, timeout=60.0, barrier=False)
    assert one["shut down"] == 1 and one["again"] == 0, one
    for rank, seen in ((0, zero), (1, one)):
        # ended by the closed connection, not by the 60 s timeout (nothing else could end it)
        assert "closed" in str(seen["error"]).lower() or "reset" in str(seen["error"]).lower(), (rank, seen)
        assert seen["peer"] == 1 - rank, (rank, seen)  # the address in gloo's error leads to the other rank


def test_the_address_in_gloos_error_is_read_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    class Store:
        def __init__(self, keys: dict[str, bytes]) -> None:
            self.keys = keys

        def check(self, keys: list[str]) -> bool:
            return all(key in self.keys for key in keys)

        def get(self, key: str) -> bytes:
            return self.keys[key]

    monkeypatch.setattr(connections, "job_store", lambda: Store({"pipe/endpoint/127.0.0.1:41234": b"3"}))
    swapped = int.from_bytes((41234).to_bytes(2, "little"), "big")  # torch 2.13's gloo writes the port so
    assert connections.rank_at(RuntimeError(f"Connection closed by peer [127.0.0.1]:{swapped}. ...")) == 3
    assert connections.rank_at(RuntimeError("Read error [127.0.0.1]:41234: Connection reset by peer")) == 3
    assert connections.rank_at(RuntimeError("Connection closed by peer [127.0.0.2]:41234")) is None
    assert connections.rank_at(RuntimeError("Timed out waiting 4000ms")) is None
