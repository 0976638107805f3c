"""The recompute/swap config in a multi-process pipeline: each rank applies its part, offload follows the schedule.

``DistributedPipe(..., recompute=config)`` takes the dict or YAML that
``Pipe(..., recompute=config)`` takes (:mod:`pipe.recompute.config`), and the
same normalisation and errors: every rank parses the whole config against the
whole pipeline (stage ``s`` = ``balance[s]`` layers, on rank ``s % ranks``),
the ranks compare the normalised result, and each rank marks only the layers
of its own stages and logs its part.

Stages are model chunks: with ``virtual_stages > 1`` a list of one count per
*stage* (``ranks x virtual_stages`` entries, chunk-major) and a 2D list
``[chunk][rank]`` (MindFormers' ``[pp_interleave_num][pipeline_stage]``) say
where each chunk's counts go; a list of one count per *rank* (MindFormers'
``pipeline_stage`` counts) is dealt round-robin over the rank's chunks, as
MindFormers does.

Offload (``swap_config``) in stages: the saved activations chosen by
``layer_swap``/``op_swap`` and, with ``checkpoint_swap``, the input a
checkpointed cell keeps for its recomputation go to host memory in the cell's
forward; they come back ``backward_prefetch`` *actions* ahead of the cell's
backward in the rank's own program (:meth:`pipe.core.schedule.Schedule.actions`),
so a 1F1B or interleaved rank prefetches the micro-batch whose backward comes
next, not the unit that was offloaded last. See docs/distributed_training.md.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import Tensor, nn

from pipe.core.microbatch import Batch
from pipe.core.lowering import Kind, Step
from pipe.core.schedule import Schedule
from pipe.distributed.group import verify_same_config
from pipe.recompute.attach import apply_strategy, warn_checkpoint_interplay
from pipe.recompute.config import ConfigSource, parse_config
from pipe.recompute.strategy import RecomputeStrategy
from pipe.recompute.offload import Offloader

__all__: list[str] = []

logger = logging.getLogger(__name__)


class RankSwap:
    """This rank's offloaders: units tagged by the cell whose forward made them, prefetched from the program.

    Args:
        strategy: the applied strategy (its offloaders for this rank's stages).
        stages: this rank's stages.
        record_events: keep :attr:`events`, the order of actions and offload
            events: ``("run", "F0@1")``, ``("offload", (0, 1), name)``,
            ``("prefetch", (0, 1), name)``, ``("fetch", ...)``, ``("use", ...)``.
    """

    def __init__(self, strategy: RecomputeStrategy, stages: Sequence[int], record_events: bool = False) -> None:
        self.record_events = record_events
        self.events: list[tuple[Any, ...]] = []
        self.layer_offloaders = {s: o for s in stages if (o := strategy.offloaders[s]) is not None}
        self.checkpoint_offloaders = {s: o for s in stages if (o := strategy.checkpoint_offloaders[s]) is not None}
        prefetches = [l.swap if l.swap is not None else l.op_swap_prefetch
                      for l in strategy.layers if l.stage in self.layer_offloaders]
        if self.checkpoint_offloaders:
            prefetches.append(strategy.checkpoint_swap)
        self.horizon = max((p for p in prefetches if p is not None), default=0)
        for offloader in self.offloaders():
            offloader.observer = self._observe

    def offloaders(self) -> list[Offloader]:
        return list(self.layer_offloaders.values()) + list(self.checkpoint_offloaders.values())

    def __bool__(self) -> bool:
        return bool(self.layer_offloaders or self.checkpoint_offloaders)

    def _observe(self, kind: str, name: str, tag: Any) -> None:
        if self.record_events:
            self.events.append((kind, tag, name))

    def offloading_stages(self) -> list[int]:
        """The stages whose backwards are prefetched (those that offload layers' or checkpoints' tensors)."""
        return sorted(set(self.layer_offloaders) | set(self.checkpoint_offloaders))

    def executors(self) -> dict[Kind, Callable[[Step], None]]:
        """The runner's executors of the offload steps of a lowered program (:func:`pipe.core.lowering.offload`).

        ``OFFLOAD a`` as the rank starts action ``a``: what its forward makes
        belongs to its cell. ``PREFETCH b``: the units of the backward ``b``
        come back now, ``ahead`` actions before it (their ``backward_prefetch``
        bounds the horizon); units made later than that (a forward right
        before its backward) come back when backward needs them.
        """
        return {Kind.OFFLOAD: self._tag, Kind.PREFETCH: self._prefetch}

    def _tag(self, step: Step) -> None:
        action = step.action
        if self.record_events:
            self.events.append(("run", str(action)))
        cell = (action.microbatch, action.stage)
        for offloader in self._of(action.stage):
            offloader.current_tag = cell  # units made by this action's forward belong to its cell

    def _prefetch(self, step: Step) -> None:
        cell = (step.microbatch, step.stage)
        for offloader in self._of(step.stage):
            offloader.prefetch(cell, step.ahead)

    def _of(self, stage: int) -> list[Offloader]:
        return [o for o in (self.layer_offloaders.get(stage), self.checkpoint_offloaders.get(stage)) if o is not None]

    def checkpoint_hooks(self, stage: int) -> Optional[Callable[[], ContextManager[Any]]]:
        """Where a checkpointed cell of ``stage`` keeps its input (None: on the device)."""
        offloader = self.checkpoint_offloaders.get(stage)
        return None if offloader is None else offloader.hooks(f"stage {stage} checkpoint")

    @staticmethod
    def tap(batch: Batch) -> tuple[Batch, Batch]:
        """Lets a checkpointed cell's received input leave the device: ``(cell input, what the runner keeps)``.

        A received tensor is an autograd leaf, which the graph holds (its
        gradient accumulator does) for as long as the cell's backward has not
        run: offloading the copy saved for recomputation would free nothing.
        The cell gets views made by :class:`_Tap` instead, whose node holds no
        tensor, and the runner keeps stand-ins (one element, broadcast to the
        shape): leaves of the tap into whose ``.grad`` autograd accumulates
        the input gradients the runner sends upstream.
        """
        indices = [k for k, t in enumerate(batch.tensors) if t.requires_grad]
        if not indices:
            return batch, batch
        tensors = batch.tensors
        stand_ins = [tensors[k].new_zeros(()).expand(tensors[k].shape).requires_grad_() for k in indices]
        # Detached: the tap's node must not reach the leaves' gradient accumulators (they hold the leaves).
        views = _Tap.apply(len(indices), *stand_ins, *[tensors[k].detach() for k in indices])
        kept = list(tensors)
        for k, view, stand_in in zip(indices, views, stand_ins):
            tensors[k], kept[k] = view, stand_in
        return batch.with_tensors(tensors), batch.with_tensors(kept)


class _Tap(torch.autograd.Function):
    """Views of ``tensors`` (no reference kept) whose gradients autograd accumulates into the stand-ins."""

    @staticmethod
    def forward(ctx: Any, n: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.n = n
        return tuple(t.view_as(t) for t in inputs[n:])  # inputs: n stand-ins, then the n tensors

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        return (None, *grads) + (None,) * ctx.n


def attach_to_ranks(
    owned: dict[int, nn.Sequential],
    config: ConfigSource,
    balance: Sequence[int],
    names: Sequence[str],
    schedule: Schedule,
    checkpoint: str,
    rank: int,
) -> tuple[RecomputeStrategy, RankSwap]:
    """Parses ``config`` for the whole pipeline on every rank, checks the ranks agree, marks this rank's layers.

    Collective: every rank of the world calls it (one ``all_gather_object``).

    Args:
        owned: this rank's stages.
        config: see :func:`pipe.recompute.parse_config`.
        balance: layers per stage (all stages).
        names: every layer's name.
        schedule: the pipeline's schedule (ranks, virtual stages).
        checkpoint: the front end's checkpoint mode.
        rank: the global rank, for the log.

    Raises:
        ValueError / TypeError: the config's own errors (the same on every
            rank), or ranks that were given different configs.
    """
    error: Optional[Exception] = None
    strategy: Optional[RecomputeStrategy] = None
    try:
        strategy = parse_config(config, balance, names, ranks=schedule.ranks)
        if schedule.splits_backward and strategy.checkpoint_swap is not None:
            raise ValueError(
                f"swap_config.checkpoint_swap is not supported with schedule={schedule.kind!r}: a split "
                "backward replays a checkpointed cell in its input-gradient half, where the kept inputs are not "
                "offloaded; drop checkpoint_swap, or use schedule='1f1b' or 'interleaved'")
        outcome: Any = strategy.to_config()
    except (TypeError, ValueError, OSError) as exc:
        error, outcome = exc, f"{type(exc).__name__}: {exc}"
    # Every rank reaches this with its outcome, so a rank whose config differs cannot leave the others waiting.
    verify_same_config({"recompute": outcome})
    if error is not None:
        raise error
    assert strategy is not None
    layers: dict[int, nn.Module] = {}
    start = 0
    for stage, size in enumerate(balance):
        if stage in owned:
            layers.update(zip(range(start, start + size), owned[stage]))
        start += size
    apply_strategy(strategy, layers, offloader=_scheduled_offloader)
    warn_checkpoint_interplay(strategy, checkpoint, "DistributedPipe", stacklevel=4)
    strategy.log(stages=sorted(owned), prefix=f"rank {rank} (stages {sorted(owned)}): ")
    return strategy, RankSwap(strategy, sorted(owned))


def _scheduled_offloader(backward_prefetch: int, min_bytes: int) -> Offloader:
    return Offloader(backward_prefetch, min_bytes=min_bytes, prefetch_on_use=False)
