"""The device's copies to and from pinned host memory: what offloading activations costs, measured.

:class:`pipe.recompute.Offloader` copies each tensor a marked layer saves for
backward to pinned host memory on a side stream during forward, and back on
the same stream before backward. The stream is one per device, so a stage's
copies queue behind each other: ``copies x latency + bytes x per_byte`` each
way (:meth:`HostCopy.seconds`). :func:`measure_host_copy` times copies of
several sizes each way with CUDA events on such a stream and fits that line
(:func:`pipe.plan.link.fit_line`); the planner charges it to the stages that
offload (:meth:`pipe.plan.cost.Costs.stage_time`).

On the CPU there is nothing to measure: offloading to host memory saves no
device memory there, so :func:`pipe.plan.profile_costs` measures no host copy
and the planner plans no offload.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from pipe.plan.link import fit_line

__all__: list[str] = []

SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
"""Bytes copied each way by :func:`measure_host_copy` (64 KiB to 64 MiB)."""


@dataclass(frozen=True)
class HostCopy:
    """Seconds per copy (``latency``) and per byte (``per_byte``) of a copy between the device and pinned host
    memory, the slower of the two ways."""

    latency: float
    per_byte: float

    def __post_init__(self) -> None:
        for name in ("latency", "per_byte"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"HostCopy.{name} must be a finite number >= 0, got {value!r}")

    def seconds(self, nbytes: int, copies: int) -> float:
        """Seconds of ``copies`` copies of ``nbytes`` bytes in all, one after another, one way."""
        return copies * self.latency + nbytes * self.per_byte

    def describe(self) -> str:
        rate = f"{1e-9 / self.per_byte:.1f} GB/s" if self.per_byte else "free"
        return f"host copy {self.latency * 1e6:.0f} us + {rate} each way"


def measure_host_copy(device: torch.device, sizes: Sequence[int] = SIZES, repeats: int = 8) -> HostCopy:
    """Times copies of ``sizes`` bytes to and from pinned host memory on a side stream of ``device`` (a CUDA
    device), the fastest of ``repeats`` of each (after two to warm up), and fits ``latency + bytes x per_byte``
    to the slower way of each size.

    Raises:
        ValueError: ``device`` is not a CUDA device (the CPU has no host copy to measure).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_host_copy needs a CUDA device, got {device}: on the CPU offloading to host "
                         f"memory saves nothing and costs nothing to plan")
    stream = torch.cuda.Stream(device)
    points: dict[int, float] = {}
    for nbytes in sizes:
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        slowest = 0.0
        for target, source in ((on_host, on_device), (on_device, on_host)):
            times = []
            for k in range(repeats + 2):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    begin.record(stream)
                    target.copy_(source, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                if k >= 2:
                    times.append(begin.elapsed_time(end) / 1000)
            slowest = max(slowest, min(times))
        points[nbytes] = slowest
    latency, per_byte = fit_line(points)
    return HostCopy(latency, per_byte)
