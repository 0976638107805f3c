"""One validated spec of a pipeline: the arguments ``Pipe`` and ``DistributedPipe`` share, checked once.

Both front ends build a :class:`PipelineSpec` first, with
:meth:`PipelineSpec.checked`, before anything is cut, allocated or
communicated: a bad value is refused here, naming the argument, the value and
the fix, the same way from either front end. The spec is frozen; the front
end then builds its runner and every collaborator (recompute and offload,
FSDP, replicas) from it, in its constructor. ``DistributedPipe`` compares
:meth:`PipelineSpec.describe` across ranks, so ranks started with different
arguments fail at once, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pipe.compile import verify_compile
from pipe.core.options import is_int, verify_checkpoint, verify_chunks
from pipe.core.schedule import Schedule

__all__: list[str] = []

LOSS_REDUCTIONS = ("mean", "sum", "count")


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline's arguments, validated.

    Attributes:
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        balance: layers per stage, or None to balance evenly.
        deferred_batch_norm: BatchNorm statistics over the whole mini-batch.
        recompute: the recompute/offload config (:mod:`pipe.recompute.config`), or None.
        compile: ``torch.compile``'s keywords (with ``exclude``), or None for eager.
        schedule: the schedule kind, or a schedule of your own (a table).
        virtual_stages: stages per rank (interleaved, looped BFS).
        loss_reduction: how ``loss_fn`` reduces: ``"mean"``, ``"sum"`` or ``"count"``.
        cpu_threads: intra-op threads per CPU partition (the thread runner), or None.
    """

    chunks: int
    checkpoint: str
    balance: Optional[tuple[int, ...]] = None
    deferred_batch_norm: bool = False
    recompute: Optional[Any] = None
    compile: Optional[dict[str, Any]] = None
    schedule: Union[str, Schedule] = "gpipe"
    virtual_stages: int = 1
    loss_reduction: str = "mean"
    cpu_threads: Optional[int] = None

    @classmethod
    def checked(cls, chunks: Any, checkpoint: Any, *, balance: Optional[Sequence[int]] = None,
                deferred_batch_norm: Any = False, recompute: Optional[Any] = None, compile: Any = False,
                tensor_parallel: bool = False, schedule: Union[str, Schedule] = "gpipe", virtual_stages: Any = 1,
                loss_reduction: Any = "mean", cpu_threads: Any = None) -> "PipelineSpec":
        """The spec of these arguments; ``tensor_parallel`` says the stages' weights become DTensors.

        Raises:
            ValueError / TypeError: naming the first bad argument, its value and the fix.
        """
        compiled = verify_compile(compile, tensor_parallel)
        if cpu_threads is not None and (not is_int(cpu_threads) or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive int or None, got {cpu_threads!r}")
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm must be True or False, got {deferred_batch_norm!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be 'mean', 'sum' or 'count', got {loss_reduction!r} ('mean': loss_fn averages "
                "over samples; 'sum': it sums; 'count': it returns (sum, count), e.g. for a mean over non-padding "
                "tokens)")
        return cls(verify_chunks(chunks), verify_checkpoint(checkpoint),
                   None if balance is None else tuple(balance), deferred_batch_norm, recompute, compiled,
                   schedule, virtual_stages, str(loss_reduction), cpu_threads)

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on, in plain values (a table schedule as its actions' names)."""
        schedule = self.schedule if isinstance(self.schedule, str) \
            else [list(map(str, self.schedule.actions(r))) for r in range(self.schedule.ranks)]
        return {"chunks": self.chunks, "checkpoint": self.checkpoint, "schedule": schedule,
                "balance": None if self.balance is None else list(self.balance),
                "virtual_stages": self.virtual_stages,
                "loss_reduction": self.loss_reduction, "deferred_batch_norm": self.deferred_batch_norm,
                "recompute": self.recompute is not None, "compile": self.compile is not None}
