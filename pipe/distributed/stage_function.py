"""What a stage runs on its rank: its partition as a cell function, with the skips that cross stages.

Skip connections (:mod:`pipe.skip`) between non-adjacent stages travel as
messages of their own: a stage that stashes a skip popped on another stage
returns it as part of its output (so ``Checkpoint``/``Recompute`` treat it as
any output), and it goes straight to the popping stage on a channel of its
own (:class:`StageSkips`; :mod:`pipe.core.lowering` routes those channels),
its gradient coming back on the paired channel. With tensor parallelism a
stage's ``DTensor`` outputs cross ranks as their local shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from pipe.core.checkpoint import Function
from pipe.core.lowering import Routes
from pipe.core.microbatch import Batch, flatten
from pipe.distributed.tensor_parallel import from_wire, to_wire
from pipe.skip.layout import SkipLayout
from pipe.skip.namespace import NamespaceOrNone, SkipKey
from pipe.skip.tracker import SkipTracker, partition_function, use_skip_tracker

__all__: list[str] = []


@dataclass
class StageSkips:
    """The skips that leave or reach one stage, as ``(other stage, key, channel name)``."""

    arriving: list[tuple[int, SkipKey, str]] = field(default_factory=list)
    leaving: list[tuple[int, SkipKey, str]] = field(default_factory=list)

    @staticmethod
    def from_layout(layout: Optional[SkipLayout], stages: int) -> list["StageSkips"]:
        """Per stage, the skips crossing stages; channels are named by route order (same on every rank)."""
        result = [StageSkips() for _ in range(stages)]
        if layout is None:
            return result
        for k, ((ns, name), (src, dst)) in enumerate(layout.routes.items()):
            if src == dst:
                continue
            channel = f"skip{k}:{name}"
            result[src].leaving.append((dst, (ns, name), channel))
            result[dst].arriving.append((src, (ns, name), channel))
        return result


class _CrossStageTracker(SkipTracker):
    """Skips within the stage are handed over as usual; crossing ones come from / go to the runner."""

    def __init__(self, arriving: dict[SkipKey, Optional[Tensor]], leaving: set[SkipKey]) -> None:
        super().__init__()
        self.arriving = arriving
        self.leaving = leaving
        self.outgoing: dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: NamespaceOrNone, name: str, tensor: Optional[Tensor]) -> None:
        if (ns, name) in self.leaving:
            self.outgoing[(ns, name)] = tensor
        else:
            super().save(batch, ns, name, tensor)

    def load(self, batch: Batch, ns: NamespaceOrNone, name: str) -> Optional[Tensor]:
        if (ns, name) in self.arriving:
            return self.arriving[(ns, name)]
        return super().load(batch, ns, name)


def skip_routes(skips: list[StageSkips]) -> Routes:
    """The channels between stages: the chain, and each skip crossing stages (for the lowering and the groups)."""
    return Routes.chain(len(skips), [(src, dst, name) for src, stage in enumerate(skips)
                                     for dst, _, name in stage.leaving])


def stage_function(partition: nn.Module, skips: StageSkips, tp_mesh: Optional[DeviceMesh] = None,
                   first: bool = True, last: bool = True) -> Function:
    """The function a cell of this stage runs (and a checkpoint replays).

    Without skips crossing the stage it is :func:`pipe.skip.tracker.partition_function`.
    Otherwise the input value is ``(value, arriving skips)`` and the output
    ``(value, leaving skips)``, so skips are ordinary inputs and outputs of the cell.
    With tensor parallelism (``tp_mesh``), every ``DTensor`` a stage sends (its
    value and its skips) crosses ranks as its local shard and is rebuilt on the
    receiving rank's mesh (:mod:`pipe.distributed.tensor_parallel`): the first
    stage's input and the last stage's output stay as they are.
    """
    function = partition_function(partition) if not skips.arriving and not skips.leaving \
        else _with_skips(partition, skips)
    if tp_mesh is None:
        return function

    def wired(batch: Batch) -> Batch:
        output = function(batch if first else Batch(from_wire(batch.value, tp_mesh)))
        return output if last else Batch(to_wire(output.value))

    return wired


def _with_skips(partition: nn.Module, skips: StageSkips) -> Function:
    arriving_keys = [key for _, key, _ in skips.arriving]
    leaving_keys = [key for _, key, _ in skips.leaving]

    def function(batch: Batch) -> Batch:
        value = batch.value
        incoming: dict[SkipKey, Optional[Tensor]] = {}
        if arriving_keys:
            value, skip_values = value
            incoming = dict(zip(arriving_keys, skip_values))
        tracker = _CrossStageTracker(incoming, set(leaving_keys))
        with use_skip_tracker(tracker):
            output = partition(value)
        if leaving_keys:
            missing = [name for ns, name in leaving_keys if (ns, name) not in tracker.outgoing]
            if missing:
                raise RuntimeError(f"skips {missing} are declared but were not stashed in this forward")
            output = (output, tuple(tracker.outgoing[key] for key in leaving_keys))
        return Batch(output)

    return function


def count_tensors(value: Any) -> int:
    return sum(1 for leaf in flatten(value)[0] if isinstance(leaf, Tensor))
