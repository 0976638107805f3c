"""The device's copies to and from pinned host memory: what offloading activations costs.

:class:`pipe.recompute.Offloader` copies each tensor a marked layer saves for
backward to pinned host memory on a side stream during forward, and back on
the same stream before backward. The stream is one per device, so a stage's
copies queue behind each other: ``copies x latency + bytes x per_byte`` each
way (:meth:`HostCopy.seconds`). :func:`pipe.plan.profile.measure_host_copy`
times copies of several sizes each way with CUDA events on such a stream and
fits that line (:func:`pipe.plan.link.fit_line`); the planner charges it to
the stages that offload (:meth:`pipe.plan.cost.Costs.stage_costs`). This module
is the planner's model (no torch); the measurement is the driver's.

On the CPU there is nothing to measure: offloading to host memory saves no
device memory there, so :func:`pipe.plan.profile_costs` measures no host copy
and the planner plans no offload.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__: list[str] = []


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
