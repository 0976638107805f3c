"""``DistributedPipe``: the multi-process front end, one or more stages per rank under torchrun.

``Pipe(model, chunks, checkpoint=...)`` for processes: every rank describes
the same model, keeps its stages, and calls ``step()`` with the inputs (used
where the first stage lives) and the targets and loss function (used where
the last stage lives). Chunks, checkpoint modes, micro-batches and schedules
mean what they mean for ``Pipe``, because they are the same code.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipe.distributed.data_parallel import GradientAverager
from pipe.distributed.group import Topology, require_initialized, verify_same_config
from pipe.distributed.loss import (LOSS_REDUCTIONS, CountedLoss, StepGradients, divide_by_count, sample_weights,
                                   verify_loss_reduction, warn_if_ignored_targets)
from pipe.distributed.runtime import MAIN, LossFn, Runtime, StageSkips, broadcast_from
from pipe.distributed.stage import ModelSpec, build_stages, even_balance, layer_count, layer_names
from pipe.distributed.recompute import attach_to_ranks
from pipe.batchnorm import convert_deferred_model, deferred_batch_norms
from pipe.recompute.config import ConfigSource
from pipe.recompute.strategy import RecomputeStrategy
from pipe.distributed.transport import Transport
from pipe.core.microbatch import Batch, gather, pack_inputs, scatter
from pipe.core.options import checkpoint_stop, pipeline_schedule, positive_int, verify_checkpoint, verify_chunks
from pipe.distributed.tied import TiedReplicas
from pipe.graph_split import keep_original_names
from pipe.skip.layout import inspect_skip_layout
from pipe.skip.skippable import verify_skippables

__all__ = ["DistributedPipe", "LOSS_REDUCTIONS"]

logger = logging.getLogger(__name__)


class DistributedPipe(nn.Module):
    """Trains an ``nn.Sequential`` as a pipeline over the ranks of a torchrun job.

    Usage (every rank runs the same script)::

        env = pipe.distributed.init_from_env()
        model = DistributedPipe(nn.Sequential(...), chunks=8, checkpoint="except_last",
                                schedule="1f1b")
        optimizer = torch.optim.Adam(model.parameters())      # this rank's layers
        for x, y in data:
            loss = model.step(x, y, loss_fn)   # loss on the last stage's rank, None elsewhere
            optimizer.step(); optimizer.zero_grad()

    Args:
        model: an ``nn.Sequential`` (build it on ``torch.device("meta")`` to
            allocate nothing; owned layers are then allocated and reset with
            ``reset_parameters()``), or a layer factory ``factory(index) ->
            nn.Module`` called only for the layers this rank owns (with ``layers=``).
        chunks: micro-batches per mini-batch; every step runs exactly ``chunks``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``, as for ``Pipe``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, or the zero-bubble
            ``"zb-h1"`` and ``"zbv"`` (:mod:`pipe.core.schedule`): each backward split
            into input and weight gradients (:mod:`pipe.core.split_backward`), a
            checkpointed cell recomputed once for both.
        balance: layers per stage (``ranks x virtual_stages`` entries);
            default: as even as possible.
        virtual_stages: stages per rank (``schedule="interleaved"``); stage s
            runs on pipeline rank ``s % ranks``. ``"zbv"`` runs 2, in a V (rank r:
            stages r and ``2 * ranks - 1 - r``).
        data_parallel: replicas of the pipeline; the world has
            ``pipeline ranks x data_parallel`` ranks and each stage's gradients
            are averaged over its replicas.
        layers: the number of layers, with a layer factory.
        loss_fn: default loss function of :meth:`step`.
        loss_reduction: ``"mean"`` (default) if ``loss_fn`` averages over the
            samples: micro-batch losses are weighted by their share of the
            batch, so the step's loss and gradients are those of the whole
            batch; ``"sum"`` if it sums; ``"count"`` if it returns ``(sum,
            count)``, e.g. for a mean over tokens that are not padding: the
            step divides by the whole (global) batch's count
            (:mod:`pipe.distributed.loss`).
        device: where this rank's layers and tensors live; default ``cuda``
            (current device) under NCCL, else the CPU.
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch (of this replica), as ``Pipe`` does; not averaged over
            replicas (docs/distributed.md).
        recompute: a recompute/swap config (YAML path or dict), as for
            ``Pipe``: stage = ``balance`` entry, each rank applies its part
            (:mod:`pipe.distributed.recompute`); the normalised strategy is
            ``recompute_strategy``.
        memory_budget: bytes per rank (``"2GiB"`` or a number): rank 0 measures
            ``model`` (an ``nn.Sequential``) on ``sample`` (with ``loss_fn`` and
            ``target``) and every rank uses the fastest chunks, balance,
            checkpoint mode and schedule predicted to fit (:mod:`pipe.plan`).
        sample, target: one mini-batch and its targets, with ``memory_budget``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError, ValueError: a bad argument, or ranks that disagree on the
            configuration (checked collectively at construction).
    """

    def __init__(
        self,
        model: ModelSpec,
        chunks: int = 1,
        checkpoint: str = "except_last",
        *,
        schedule: str = "1f1b",
        balance: Optional[Sequence[int]] = None,
        virtual_stages: int = 1,
        data_parallel: int = 1,
        layers: Optional[int] = None,
        loss_fn: Optional[LossFn] = None,
        loss_reduction: str = "mean",
        device: Optional[torch.device] = None,
        deferred_batch_norm: bool = False,
        recompute: Optional[ConfigSource] = None,
        memory_budget: Optional[Any] = None,
        sample: Any = None,
        target: Any = None,
    ) -> None:
        super().__init__()
        if memory_budget is not None:  # rank 0 plans (pipe.plan), every rank applies its choice
            from pipe.plan.apply import plan_for_ranks

            require_initialized()
            planned = plan_for_ranks(model, sample, memory_budget, balance, dist.get_world_size() // data_parallel,
                                     loss_fn, target)
            chunks, checkpoint, schedule = planned["chunks"], planned["checkpoint"], planned["schedule"]
            balance, virtual_stages = planned["balance"], planned["virtual_stages"]
            recompute = planned.get("recompute") if recompute is None else recompute  # per-stage counts
        self.chunks = verify_chunks(chunks)
        self.checkpoint = verify_checkpoint(checkpoint)
        positive_int("data_parallel", data_parallel, "replicas of the pipeline")
        self.loss_reduction = verify_loss_reduction(loss_reduction)
        self._warned_ignored_targets = False
        self.loss_fn = loss_fn
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm must be True or False, got {deferred_batch_norm!r}")
        if deferred_batch_norm:
            model = convert_deferred_model(model)
        layers = layer_count(model, layers)
        require_initialized()
        # Compare before anything can block: a rank with another configuration fails here.
        verify_same_config({
            "chunks": chunks, "checkpoint": checkpoint, "schedule": schedule,
            "balance": None if balance is None else list(balance), "virtual_stages": virtual_stages,
            "data_parallel": data_parallel, "layers": layers, "loss_reduction": loss_reduction,
            "deferred_batch_norm": deferred_batch_norm, "recompute": recompute is not None,
        })
        self.topology = Topology(data_parallel)
        self.schedule = pipeline_schedule(schedule, self.topology.ranks, self.chunks, virtual_stages)
        self.balance = list(balance) if balance is not None else even_balance(layers, self.schedule.stages)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
                else torch.device("cpu")
        self.device = torch.device(device)
        self.partitions, skeleton = build_stages(model, layers, self.balance, self.schedule,
                                                 self.topology.pipeline_rank, self.device)
        verify_skippables(nn.Sequential(*[layer for part in skeleton for layer in part]))
        layout = inspect_skip_layout(skeleton)
        self.skips = StageSkips.from_layout(layout if layout else None, self.schedule.stages)
        routes = [(s, s + 1, MAIN) for s in range(self.schedule.stages - 1)]
        routes += [(s, dst, name) for s, stage in enumerate(self.skips) for dst, _, name in stage.leaving]
        self.topology.create_groups(routes, self.schedule.rank_of)
        self._pipeline_group: Optional[dist.ProcessGroup] = None
        if self.topology.ranks > 1:
            for replica in range(data_parallel):
                members = [self.topology.global_rank(p, replica) for p in range(self.topology.ranks)]
                group = self.topology.new_group(members)
                if replica == self.topology.replica:
                    self._pipeline_group = group
        # Owned layers are this module's children under their original names, so
        # state_dict() keys are those of the original nn.Sequential.
        for stage in sorted(self.partitions):
            for name, layer in self.partitions[stage].named_children():
                self.add_module(name, layer)
        keep_original_names(self)  # stages of pipe.split: the original model's keys
        self._tied = TiedReplicas(skeleton, self.schedule, self.topology)  # weights shared across ranks
        averager = None
        if data_parallel > 1:
            averager = GradientAverager(dict(self.partitions), self.topology.data_parallel_group, data_parallel)
        self._runtime = Runtime(self.partitions, self.schedule, self.topology, Transport(self.device, self.topology.timeout),
                                self.skips, averager)
        self._deferred_batch_norms = [bn for p in self.partitions.values() for bn in deferred_batch_norms(p)]
        self.recompute_strategy: Optional[RecomputeStrategy] = None
        if recompute is not None:
            self.recompute_strategy, self._runtime.swap = attach_to_ranks(
                self.partitions, recompute, self.balance, layer_names(model, layers), self.schedule,
                self.checkpoint, self.topology.rank)
        logger.info("DistributedPipe: rank %d = pipeline rank %d of replica %d, stages %s, schedule %s, "
                    "chunks %d, checkpoint %s", self.topology.rank, self.topology.pipeline_rank,
                    self.topology.replica, sorted(self.partitions), schedule, chunks, checkpoint)

    # -- where things live --------------------------------------------------------------------

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs."""
        return sorted(self.partitions)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (and takes the inputs)."""
        return 0 in self.partitions

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (and takes the targets and computes the loss)."""
        return self.schedule.stages - 1 in self.partitions

    # -- training and inference -----------------------------------------------------------------

    def step(self, inputs: Any = None, target: Any = None, loss_fn: Optional[LossFn] = None, *,
             broadcast_loss: bool = False) -> Optional[Tensor]:
        """Runs forward and backward of one mini-batch; gradients accumulate in ``.grad``.

        Args:
            inputs: what the first layer takes (a tensor, or a tuple for several);
                used on the rank of the first stage, ignored elsewhere.
            target: the loss function's second argument; used on the rank of the last stage.
            loss_fn: ``loss_fn(output, target) -> scalar tensor`` (``(sum, count)``
                with ``loss_reduction="count"``); default the constructor's.
            broadcast_loss: return the loss on every rank (one broadcast), not only the last stage's.

        Returns:
            The mini-batch's loss (averaged over data-parallel replicas), on the
            rank of the last stage, or everywhere with ``broadcast_loss``; else None.

        Raises:
            ValueError, TypeError: bad inputs or targets. If any rank fails, the
            failing rank re-raises its error and the others raise
            :class:`pipe.distributed.PipelineFailure` naming it.
        """
        loss_fn = loss_fn or self.loss_fn
        targets = weights = None
        try:  # a bad argument on one rank must not leave the others waiting: report it
            batches = self._scatter(inputs, "inputs") if self.is_first else None
            if self.is_last:
                if loss_fn is None:
                    raise ValueError("the rank of the last stage needs loss_fn, in step() or in the constructor")
                targets = self._scatter(target, "target")
                weights = sample_weights(self.loss_reduction, targets)
                if not self._warned_ignored_targets:
                    self._warned_ignored_targets = warn_if_ignored_targets(self.loss_reduction, target)
        except (TypeError, ValueError) as error:
            self._runtime.failures.begin_step()  # the step the other ranks run
            raise self._runtime.failures.failure_from("step()", error) from None
        stop = checkpoint_stop(self.checkpoint, self.chunks) if torch.is_grad_enabled() else 0
        for bn in self._deferred_batch_norms:
            bn.discard()  # what a failed step left behind
        # "count": each micro-batch back-propagates its sum; the step divides by the count at the end.
        counted = CountedLoss(loss_fn) if self.loss_reduction == "count" and loss_fn is not None else None
        step_grads = StepGradients(self) if self.loss_reduction == "count" else None
        try:
            with torch.enable_grad():
                loss, _ = self._runtime.run(batches, targets, counted or loss_fn, stop, weights, training=True)
        except BaseException:
            if step_grads is not None:
                step_grads.abandon()
            raise
        if step_grads is not None:
            loss = self._divide_by_count(counted, loss, step_grads)
        for bn in self._deferred_batch_norms:
            bn.commit()  # running statistics once per mini-batch
        if self.is_last and self.topology.data_parallel > 1:
            assert loss is not None
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.topology.data_parallel_group)
            loss /= self.topology.data_parallel
        self._tied.reduce_gradients()  # tied weights: the replicas' gradients summed over their ranks
        if broadcast_loss and self.topology.ranks > 1:
            source = self.topology.global_rank(self.schedule.rank_of(self.schedule.stages - 1))
            loss = broadcast_from(loss, source, self._pipeline_group, self.device)
        return loss

    def _divide_by_count(self, counted: Optional[CountedLoss], loss: Optional[Tensor],
                         step_grads: StepGradients) -> Optional[Tensor]:
        """Divides this step's gradients and loss by the global count (``loss_reduction="count"``)."""
        source = self.topology.global_rank(self.schedule.rank_of(self.schedule.stages - 1))

        def broadcast(value: Optional[Tensor]) -> Tensor:
            if self.topology.ranks == 1:
                assert value is not None
                return value
            return broadcast_from(value, source, self._pipeline_group, self.device)

        # Every rank learns the same count, so a count of 0 raises the same ValueError everywhere.
        return divide_by_count(counted, loss, step_grads, is_last=self.is_last,
                               data_parallel_group=self.topology.data_parallel_group,
                               replicas=self.topology.data_parallel, broadcast=broadcast, device=self.device)

    def forward(self, *inputs: Any) -> Any:
        """Runs forwards only (no graph is kept): the output on the last stage's rank, None elsewhere.

        Every rank of the pipeline must call it; ``inputs`` matter on the first stage's rank.
        """
        batches = self._scatter(pack_inputs(inputs) if inputs else None, "inputs") if self.is_first else None
        for bn in self._deferred_batch_norms:
            bn.discard()
        with torch.no_grad():
            _, outputs = self._runtime.run(batches, None, None, 0, None, training=False)
        for bn in self._deferred_batch_norms:
            bn.commit()
        return gather(outputs) if outputs else None

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clips the gradients of the whole pipeline to a global norm, like ``torch.nn.utils.clip_grad_norm_``.

        The norm is over every stage's gradients (one all-reduce over the
        pipeline ranks), so each rank scales by the same factor as a single
        process would. Every rank of the pipeline must call it.

        Returns:
            The total norm before clipping, on every rank.
        """
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), device=self.device, dtype=torch.float64)
        for p in self.parameters():
            if p.grad is not None and self._tied.counts(p):  # a tied weight counts once
                squares += p.grad.detach().double().pow(2).sum()
        if self._pipeline_group is not None:
            dist.all_reduce(squares, group=self._pipeline_group)
        total = squares.sqrt()
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
        return total.float()

    def _scatter(self, value: Any, what: str) -> list[Batch]:
        if value is None:
            raise ValueError(f"this rank runs the {'first' if what == 'inputs' else 'last'} stage and needs {what}; "
                             f"pass {what}= to step()")
        batches = scatter(value, self.chunks)
        if len(batches) != self.chunks:
            raise ValueError(
                f"{what} has batch size {len(batches)}, smaller than chunks={self.chunks}; a multi-process "
                f"pipeline runs exactly chunks micro-batches per step (every rank must know the count), "
                f"so pass at least {self.chunks} samples or use fewer chunks"
            )
        return batches

