"""R3 under torchrun: a long run holds steady, whatever the layout.

Many steps, with what a long run does besides (an evaluation, an asynchronous
save and a prune every 5 steps), leave alive about what a few steps leave:
the tensors a step replaces (its gradients), as many of pipe's own objects, no
new thread, the same open files (sockets included). A leak grows with the
number of steps: 65 steps instead of 5 would leave 60 more tensors for a leak
of one a step, 12 more threads or files for one a save. The bounds are half
that, since gloo's worker threads let go of a collective's tensors a moment
after the collective returns (3 were seen still held after a short run on a
loaded machine). Tensors are counted by identity while everything alive
before is held, so no freed tensor's id is reused by a new one.
"""
from __future__ import annotations

import gc
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dist_models import batch, blocks
from pipe.distributed import DistributedPipe, Shard, make_mesh, state
from spawn_ranks import run_ranks


def _alive() -> tuple[list[torch.Tensor], Counter[str], set[threading.Thread]]:
    gc.collect()
    objects = gc.get_objects()
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    ours = Counter(type(o).__qualname__ for o in objects if str(getattr(type(o), "__module__", "")).startswith("pipe."))
    return tensors, ours, set(threading.enumerate())


def _left_alive(run: Callable[[], None]) -> tuple[int, dict[str, int], int, int]:
    """What ``run`` left alive: new tensors, the change in the count of each of pipe's classes' objects, new
    threads; and the open file descriptors after it."""
    tensors, ours, threads = _alive()
    run()
    after_tensors, after_ours, after_threads = _alive()
    known = {id(t) for t in tensors}
    grown = {name: after_ours[name] - ours[name] for name in after_ours | ours if after_ours[name] != ours[name]}
    return (sum(1 for t in after_tensors if id(t) not in known), grown, len(after_threads - threads),
            len(os.listdir("/proc/self/fd")))


def _steady(rank: int, world: int, directory: str) -> list[str]:
    layouts: list[tuple[str, dict[str, Any]]] = [
        ("1f1b", dict(mesh=make_mesh(pp=2))),
        ("zbv", dict(mesh=make_mesh(pp=2), schedule="zbv")),
        ("interleaved", dict(mesh=make_mesh(pp=2), schedule="interleaved", virtual_stages=2)),
        ("fsdp a layer at a time", dict(mesh=make_mesh(pp=1, dp_shard=2),
                                        shard=Shard(unit="block", reduce="micro-batch"))),
        ("replicas", dict(mesh=make_mesh(pp=1, dp_replicate=2))),
    ]
    checked = []
    for label, kwargs in layouts:
        torch.manual_seed(0)
        pipe = DistributedPipe(blocks(8), chunks=4, **kwargs)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        inputs, target = batch(16)
        checkpoints = Path(directory) / label
        done = 0

        def steps(n: int) -> None:
            nonlocal done
            for _ in range(n):
                optimizer.zero_grad()
                pipe.step(inputs, target, F.mse_loss)
                optimizer.step()
                done += 1
                if done % 5 == 0:
                    pipe.eval_step(inputs, target, F.mse_loss)
                    state.save(state.step_path(checkpoints, done), pipe, optimizer, asynchronous=True)
                    state.prune(checkpoints, keep=2)
            state.wait()

        steps(10)  # first steps build what later ones reuse (the optimizer's state, the transport's guesses)
        short = _left_alive(lambda: steps(5))
        long = _left_alive(lambda: steps(65))
        said = f"{label}: 5 steps left (tensors, pipe's objects, threads, files) {short}, 65 left {long}"
        assert long[0] - short[0] < 30, said  # 60 more steps: a tensor a step would leave 60 more
        assert all(count - short[1].get(name, 0) < 30 for name, count in long[1].items()), said
        assert long[2] - short[2] < 6 and long[3] - short[3] < 6, said  # 12 more saves
        assert state.latest(checkpoints) == state.step_path(checkpoints, done), f"{label}: the last save is not published"
        checked.append(label)
    return checked


def test_a_long_run_holds_steady_on_every_layout(tmp_path: Path) -> None:
    results = run_ranks(_steady, 2, str(tmp_path), deadline=300.0)
    assert results == [["1f1b", "zbv", "interleaved", "fsdp a layer at a time", "replicas"]] * 2
