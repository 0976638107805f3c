"""The point-to-point transport on 2 gloo ranks: values arrive whole whether the layout guess holds or not."""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pipe.distributed.transport import Channel, Transport
from spawn_ranks import run_ranks


def _values() -> list[tuple[int, Any]]:
    """(micro-batch, value) in sending order: repeats (guess holds) and changes (guess fails)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return [
        (0, randn(3, 4)),  # no guess yet
        (1, (randn(2, 4), {"ids": torch.arange(2), "scale": 0.5})),
        (0, randn(3, 4).requires_grad_()),  # same layout: the guess holds; requires_grad travels in the header
        (1, (randn(2, 4), {"ids": torch.arange(2), "scale": 2.0})),  # holds; a new Python leaf
        (0, randn(2, 4)),  # another batch size
        (1, (randn(2, 4).double(), {"ids": torch.arange(2), "scale": 2.0})),  # another dtype
        (0, [randn(2, 4), randn(0, 4), randn(1)]),  # more tensors, one empty
        (1, randn(5)),  # fewer tensors
        (0, [randn(2, 4), randn(0, 4), randn(1)]),  # holds again: the header repeats (8 bytes, no pickle)
        (1, randn(5)),  # holds again: repeats
        (1, (randn(2, 4), {"ids": torch.arange(2), "scale": 2.0})),  # another structure: a whole header
        (1, (randn(2, 4), {"ids": torch.arange(2), "scale": 2.0})),  # repeats, its Python leaf included
        (1, (randn(2, 4), {"ids": torch.arange(2), "scale": 3.0})),  # a new Python leaf: a whole header
        (1, (randn(2, 4).requires_grad_(), {"ids": torch.arange(2), "scale": 3.0})),  # requires_grad: whole
        (2, randn(130, 128)),  # more than INLINE_BYTES
        (2, randn(130, 128)),  # holds: a repeated header, the tensor in a message of its own
        (3, (randn(2, 4), "a" * 2000)),  # a header longer than HEADER_BYTES: its rest in a second message
        (3, (randn(2, 4), "b" * 2000)),  # holds, a new long Python leaf: header, its rest, the tensor inline
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _exchange(rank: int, world: int) -> tuple[bool, list[Any]]:
    default = Transport(torch.device("cpu"), datetime.timedelta(seconds=20)).guess
    checked: list[Any] = []
    for guess in (True, False):
        transport = Transport(torch.device("cpu"), datetime.timedelta(seconds=20), guess=guess)
        channel = Channel(1 - rank, dist.group.WORLD, f"test {guess}")
        for microbatch, value in _values():
            if rank == 0:
                transport.send(value, channel, microbatch)
            else:
                incoming = transport.receive(channel, microbatch)
                checked.append(_same(value, incoming.wait()))
        transport.flush()
        if rank == 0:
            checked.append({name: int(transport.stats[name])
                            for name in ("messages", "headers", "repeated_headers", "inline")})
    return default, checked


def test_values_arrive_whole_whether_the_layout_guess_holds_or_not() -> None:
    (guess0, sent), (guess1, received) = run_ranks(_exchange, 2)
    assert guess0 and guess1, "the receiver guesses layouts on gloo by default"
    assert received == [True] * 2 * len(_values())
    count = len(_values())
    # With guesses: the 8 small values whose layout held travelled inline, in their header's message, and 4
    # values repeated their channel's last header (8 bytes, no pickle). Without: a whole header per message.
    assert sent == [{"messages": count, "headers": count - 4, "repeated_headers": 4, "inline": 8},
                    {"messages": count, "headers": count, "repeated_headers": 0, "inline": 0}]


def _many_pipelines(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch.nn.functional as F
    from torch import nn

    from pipe.distributed import DistributedPipe

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    threads, losses = [], []
    for k in range(6):
        for schedule in ("1f1b", "interleaved"):
            model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
            piped = DistributedPipe(model, chunks=2, schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1)
            losses.append(float(piped.step(x, y, F.mse_loss, broadcast_loss=True)))
            plain_loss = float(F.mse_loss(model(x), y))  # the same parameters, run plainly on this rank
            assert abs(losses[-1] - plain_loss) < 1e-6, (losses[-1], plain_loss)
        threads.append(len(os.listdir("/proc/self/task")))
    return {"threads": threads}


def test_pipelines_of_one_process_share_their_groups() -> None:
    """Each gloo group holds threads until the process ends: the 12th pipeline of a process adds none."""
    for result in run_ranks(_many_pipelines, 2):
        threads = result["threads"]
        assert threads[-1] == threads[0], threads
