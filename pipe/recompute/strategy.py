"""The recompute strategy: what each layer of a model cut into stages does, after precedence.

A config (:mod:`pipe.recompute.config`) is read into a :class:`RecomputeStrategy`,
one :class:`LayerStrategy` per layer; :mod:`pipe.recompute.attach` puts it on
the layers of ``Pipe``'s partitions or of a ``DistributedPipe`` rank's stages.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pipe.recompute.offload import Offloader

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerStrategy:
    """What one layer does, after precedence."""

    index: int
    stage: int
    name: str
    recompute: bool = False
    select: tuple[str, ...] = ()
    swap: Optional[int] = None                 # backward_prefetch of a whole-layer swap
    op_swap: tuple[str, ...] = ()              # submodule regexes whose saved tensors are offloaded
    op_swap_prefetch: Optional[int] = None
    dropped: tuple[str, ...] = ()              # what precedence removed, for the log

    def describe(self) -> str:
        parts = []
        if self.recompute:
            parts.append("full recompute")
        if self.select:
            parts.append(f"select_recompute {list(self.select)}")
        if self.swap is not None:
            parts.append(f"swap backward_prefetch={self.swap}")
        if self.op_swap:
            parts.append(f"op_swap {list(self.op_swap)} backward_prefetch={self.op_swap_prefetch}")
        text = ", ".join(parts) or "no recompute"
        if self.dropped:
            text += f" ({'; '.join(self.dropped)})"
        return text


@dataclass
class RecomputeStrategy:
    """A normalised recompute/swap configuration for a model cut into stages.

    Attributes:
        stages: layers per stage.
        layers: one :class:`LayerStrategy` per layer, in order.
        swap: whether the swap section is on.
        checkpoint_swap: backward_prefetch for the partition-boundary
            checkpoints ``Pipe`` keeps, or None.
        offloaders: one :class:`Offloader` per stage for layer/op swap (None
            where the stage offloads nothing); filled by :func:`apply_recompute_config`.
        checkpoint_offloaders: the same for ``checkpoint_swap``.
    """

    stages: list[int]
    layers: list[LayerStrategy]
    swap: bool = False
    default_prefetch: int = 1
    min_bytes: int = 1024
    checkpoint_swap: Optional[int] = None
    canonical: dict[str, Any] = field(default_factory=dict)
    offloaders: list[Optional[Offloader]] = field(default_factory=list)
    checkpoint_offloaders: list[Optional[Offloader]] = field(default_factory=list)

    def to_config(self) -> dict[str, Any]:
        """The normalised config: a dict that :func:`parse_config` reads back into this strategy."""
        return {section: dict(values) for section, values in self.canonical.items()}

    def checkpoint_offload(self, stage: int) -> Optional[Callable[[], Any]]:
        """The offload hooks for the checkpoints kept at the input of ``stage`` (None: keep them)."""
        if stage >= len(self.checkpoint_offloaders):
            return None
        offloader = self.checkpoint_offloaders[stage]
        return None if offloader is None else offloader.hooks(f"stage {stage} checkpoint", self.checkpoint_swap)

    def log(self, stages: Optional[Sequence[int]] = None, prefix: str = "") -> None:
        """Logs the normalised config, then one line per layer (of ``stages`` only, if given)."""
        logger.info("%srecompute strategy (normalised; valid as a config): %r", prefix, self.to_config())
        for layer in self.layers:
            if stages is None or layer.stage in stages:
                logger.info("%slayer %d (stage %d, %s): %s", prefix, layer.index, layer.stage, layer.name,
                            layer.describe())
        if self.checkpoint_swap is not None:
            logger.info("%scheckpoint_swap: inputs kept at partition boundaries go to host memory, "
                        "backward_prefetch=%d", prefix, self.checkpoint_swap)
