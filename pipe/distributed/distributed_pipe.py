"""``DistributedPipe``: the multi-process front end, one or more stages per rank under torchrun.

``Pipe(model, chunks, checkpoint=...)`` for processes: every rank describes
the same model, keeps its stages, and calls ``step()`` with the inputs (used
where the first stage lives) and the targets and loss function (used where
the last stage lives). Chunks, checkpoint modes, micro-batches and schedules
mean what they mean for ``Pipe``, because they are the same code.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from pipe.distributed.fsdp import Shard, describe_shard, refuse_wrapped, verify_shard
from pipe.distributed.mesh import pipeline_mesh, verify_mesh
from pipe.distributed.env import rank_device
from pipe.distributed.group import Topology, require_initialized, union_over_ranks, verify_same_config
from pipe.distributed.names import PlainNamed, PlainNames
from pipe.distributed.parallelism import clip_grad_norm, parallelize_stages, verify_parallelism
from pipe.distributed.accumulation import Accumulation
from pipe.distributed.loss import (CountedLoss, LossFn, divide_step_by_count, replica_share, sample_weights,
                                  share_loss, warn_if_ignored_targets)
from pipe.distributed.runtime import Runtime
from pipe.distributed.stage_function import StageSkips, skip_routes
from pipe.distributed.stage import ModelSpec, build_stages, even_balance, layer_count, layer_names
from pipe.distributed.materialize import allocate_for_load, refuse_not_on_meta
from pipe.distributed.recompute_ranks import attach_to_ranks
from pipe.batchnorm import convert_deferred_model, deferred_batch_norms
from pipe.recompute.config import ConfigSource
from pipe.recompute.strategy import RecomputeStrategy
from pipe.distributed.transport import Transport
from pipe.core.schedule import Schedule
from pipe.compile import CompileOption, compile_stages
from pipe.spec import PipelineSpec
from pipe.core.microbatch import Batch, gather, pack_inputs, scatter_exactly, verify_device
from pipe.core.options import checkpoint_stop, pipeline_schedule
from pipe.distributed.tied_replicas import TiedReplicas
from pipe.graph_split import keep_original_names
from pipe.split_stage import retarget_split_stages
from pipe.skip.layout import inspect_skip_layout
from pipe.skip.skippable import verify_skippables

__all__: list[str] = []

logger = logging.getLogger(__name__)


class DistributedPipe(PlainNamed, nn.Module):
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
        model: an ``nn.Sequential`` or ``pipe.PipeSequential``, such as a model
            cut by :func:`pipe.split` (build it on ``torch.device("meta")`` to
            allocate nothing; owned layers are then allocated and initialised
            by their modules' ``reset_parameters()`` and, for a split model, the
            model's own initialiser such as HuggingFace's ``_init_weights``; a
            tensor neither sets is refused, :mod:`pipe.distributed.materialize`),
            or a layer factory ``factory(index) -> nn.Module`` called only for
            the layers this rank owns (with ``layers=``).
        chunks: micro-batches per mini-batch; every step runs exactly ``chunks``.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``, as for ``Pipe``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, or the zero-bubble
            ``"zb-h1"`` and ``"zbv"`` (:mod:`pipe.core.schedule`): each backward split
            into input and weight gradients (:mod:`pipe.core.iw_backward`), a
            checkpointed cell recomputed once for both. Or a schedule of your own
            as a table (:class:`pipe.core.schedule_table.TableSchedule`).
        balance: layers per stage (``ranks x virtual_stages`` entries);
            default: as even as possible.
        virtual_stages: stages per rank (``schedule="interleaved"``); stage s
            runs on pipeline rank ``s % ranks``. ``"zbv"`` runs 2, in a V (rank r:
            stages r and ``2 * ranks - 1 - r``).
        mesh: the job's ``DeviceMesh`` (:func:`pipe.distributed.make_mesh`):
            dimension "pp" (required) carries the stages, "dp_replicate" full
            replicas, "dp_shard" FSDP2 shards, "tp" tensor parallelism
            (:mod:`pipe.distributed.mesh`). Each rank passes its share of the
            global batch (its part is ``topology.replica`` of ``topology.data_parallel``).
            Default: every rank one stage of a single pipeline (the mesh
            ``("pp",)``). Replicas of the pipeline:
            ``make_mesh(pp=world // replicas, dp_replicate=replicas)``.
        shard: how FSDP2 shards the stages over "dp_shard"
            (:class:`pipe.distributed.Shard`); default ``Shard()`` when the mesh
            has a "dp_shard" dimension: ZeRO-3, each layer gathered around its
            own forward and backward (a stage whole with a zero-bubble schedule).
        parallelize: ``parallelize(stage, mesh)`` is called on each of this
            rank's stages (an ``nn.Sequential`` of its layers under their
            plain-model names) before FSDP wraps them, e.g. to apply
            ``parallelize_module`` on ``mesh["tp"]``.
        tensor_parallel: ``{module name or fnmatch pattern: ParallelStyle}``
            applied with torch's ``parallelize_module`` on ``mesh["tp"]`` to the
            modules of this rank's stages (names as in ``named_modules()``: the
            plain model's), before FSDP; an entry that matches no module of any
            stage is refused. A stage output that is a ``DTensor`` crosses ranks
            as its local shard and is rebuilt on the receiver
            (:mod:`pipe.distributed.tensor_parallel`). Every tp rank of a stage
            takes the same inputs and targets.
        layers: the number of layers, with a layer factory.
        loss_fn: default loss function of :meth:`step`.
        loss_reduction: ``"mean"`` (default) if ``loss_fn`` averages over the
            samples: micro-batch losses are weighted by their share of the
            batch, so the step's loss and gradients are those of the whole
            batch; ``"sum"`` if it sums; ``"count"`` if it returns ``(sum,
            count)``, e.g. for a mean over tokens that are not padding: the
            step divides by the whole global batch's count, summed over every
            data-parallel rank (replicas and shards): the token mean over the
            global batch (:mod:`pipe.distributed.loss`).
        device: where this rank's layers and tensors live; default ``cuda``
            (current device) under NCCL, else the CPU.
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch (of this replica), as ``Pipe`` does; not averaged over
            replicas (docs/distributed_training.md).
        recompute: a recompute/swap config (YAML path or dict), as for
            ``Pipe``: stage = ``balance`` entry, each rank applies its part
            (:mod:`pipe.distributed.recompute_ranks`); the normalised strategy is
            ``recompute_strategy``.
        compile: compile each layer of this rank's stages with ``torch.compile``,
            as for ``Pipe`` (:mod:`pipe.compile`).
        init_weights: False, for a model built on ``meta`` whose weights a load
            will set (:func:`pipe.distributed.hf.load`, :func:`pipe.distributed.state.load`):
            tensor parallelism and FSDP shard the stages while they are still on
            ``meta``, then each rank allocates only its shards, never the whole
            stage, and initialises nothing the load overwrites (only
            non-persistent buffers such as a rotary ``inv_freq``). No seed is
            needed: the partners' values come from one checkpoint. The steps
            refuse to run until the load.

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
        schedule: Union[str, Schedule] = "1f1b",
        balance: Optional[Sequence[int]] = None,
        virtual_stages: int = 1,
        mesh: Optional[DeviceMesh] = None,
        shard: Optional[Shard] = None,
        parallelize: Optional[Callable[[nn.Sequential, DeviceMesh], None]] = None,
        tensor_parallel: Optional[Mapping[str, Any]] = None,
        layers: Optional[int] = None,
        loss_fn: Optional[LossFn] = None,
        loss_reduction: str = "mean",
        device: Optional[torch.device] = None,
        deferred_batch_norm: bool = False,
        recompute: Optional[ConfigSource] = None,
        compile: CompileOption = False,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        tensor_parallel = verify_parallelism(parallelize, tensor_parallel, mesh)
        spec = self.spec = PipelineSpec.checked(
            chunks, checkpoint, balance=balance, deferred_batch_norm=deferred_batch_norm, recompute=recompute,
            compile=compile, tensor_parallel=tensor_parallel is not None or parallelize is not None,
            schedule=schedule, virtual_stages=virtual_stages, loss_reduction=loss_reduction)
        self.chunks, self.checkpoint, self.loss_reduction = spec.chunks, spec.checkpoint, spec.loss_reduction
        self._warned_ignored_targets = False
        self._accumulation: Optional[Accumulation] = None  # the passes of step(accumulate=True) so far
        self.loss_fn = loss_fn
        if isinstance(model, nn.Module):
            refuse_wrapped(model)  # on every rank alike, before anything collective
        if deferred_batch_norm:
            model = convert_deferred_model(model)
        layers = layer_count(model, layers)
        if not init_weights:
            refuse_not_on_meta(model)
        require_initialized()
        if mesh is not None:
            verify_mesh(mesh, rank_device(device))
        # Compare before anything can block: a rank with another configuration fails here.
        verify_same_config({
            **spec.describe(), "layers": layers,
            "mesh": None if mesh is None else [mesh.mesh_dim_names, mesh.mesh.tolist()],
            "shard": describe_shard(shard), "parallelize": parallelize is not None,
            "tensor_parallel": None if tensor_parallel is None else sorted(tensor_parallel),
        })
        if mesh is None:
            mesh = pipeline_mesh()
        shard = verify_shard(shard, mesh)
        self.topology = Topology(mesh)
        self.schedule = pipeline_schedule(spec.schedule, self.topology.ranks, self.chunks, spec.virtual_stages)
        self.balance = list(spec.balance) if spec.balance is not None \
            else even_balance(layers, self.schedule.stages, model, self.schedule)
        self.device = rank_device(device)
        self.partitions, skeleton = build_stages(model, layers, self.balance, self.schedule,
                                                 self.topology.pipeline_rank, self.device, union_over_ranks,
                                                 initialise=init_weights)
        verify_skippables(nn.Sequential(*[layer for part in skeleton for layer in part]))
        layout = inspect_skip_layout(skeleton)
        self.skips = StageSkips.from_layout(layout if layout else None, self.schedule.stages)
        self.topology.create_groups(skip_routes(self.skips).channels(), self.schedule.rank_of)
        self._pipeline_group = self.topology.pipeline_group
        # Owned layers are this module's children under their original names, so
        # state_dict() keys are those of the original nn.Sequential.
        for stage in sorted(self.partitions):
            for name, layer in self.partitions[stage].named_children():
                self.add_module(name, layer)
        keep_original_names(self)  # stages of pipe.split: the original model's keys
        self.compiled_layers = compile_stages(self.partitions.values(), spec.compile)
        self._tied = TiedReplicas(skeleton, self.schedule, self.topology)  # weights shared across ranks
        self.plain_names = PlainNames(self, skeleton)  # named_parameters() and named_modules() as the plain model
        if not init_weights:  # a split stage's graph devices now, before FSDP changes the stages' classes
            retarget_split_stages(self.partitions.values(), self.device)
        # Tensor parallelism first, then FSDP (or the replicas' averager), as torchtitan composes them.
        if shard is not None:  # the unit for this schedule: a block at a time under ZeRO-3 where it can be
            shard = shard.with_unit(schedule, self.schedule.splits_backward)
            logger.info("FSDP2 gathers %s at a time", "a block" if shard.unit == "block" else "a stage")
        self.shard = shard
        sharding, averager = parallelize_stages(self.partitions, skeleton, mesh, self.topology, self._tied, shard,
                                                parallelize, tensor_parallel, schedule)
        self.awaiting_load = not init_weights
        """True until :func:`pipe.distributed.hf.load` or :func:`pipe.distributed.state.load` has filled the
        tensors that ``init_weights=False`` left unset; the steps refuse to run before."""
        if not init_weights:  # sharded on meta above: each rank allocates its shards only
            allocate_for_load(list(self.partitions.values()), self.device)
            self._tied.refresh()
        self._deferred_batch_norms = [bn for p in self.partitions.values() for bn in deferred_batch_norms(p)]
        self.recompute_strategy: Optional[RecomputeStrategy] = None
        swap = None
        if spec.recompute is not None:
            self.recompute_strategy, swap = attach_to_ranks(
                self.partitions, spec.recompute, self.balance, layer_names(model, layers), self.schedule,
                self.checkpoint, self.topology.rank)
        self._runtime = Runtime(self.partitions, self.schedule, self.topology, Transport(self.device, self.topology.timeout),
                                self.skips, averager, sharding, swap)
        logger.info("DistributedPipe: rank %d = pipeline rank %d of replica %d, stages %s, schedule %s, "
                    "chunks %d, checkpoint %s", self.topology.rank, self.topology.pipeline_rank,
                    self.topology.replica, sorted(self.partitions), self.schedule, self.chunks, self.checkpoint)

    # -- where things live --------------------------------------------------------------------

    @property
    def mesh(self) -> DeviceMesh:
        """The job's ``DeviceMesh`` (``("pp",)`` over the world when none was given)."""
        return self.topology.mesh

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
             broadcast_loss: bool = False, accumulate: bool = False) -> Optional[Tensor]:
        """Runs forward and backward of one mini-batch; gradients accumulate in ``.grad``.

        Args:
            inputs: what the first layer takes (a tensor, or a tuple for several);
                used on the rank of the first stage, ignored elsewhere.
            target: the loss function's second argument; used on the rank of the last stage.
            loss_fn: ``loss_fn(output, target) -> scalar tensor`` (``(sum, count)``
                with ``loss_reduction="count"``); default the constructor's.
            broadcast_loss: return the loss on every rank (one broadcast), not only the last stage's.
            accumulate: this pass is not the last of an optimizer step: its
                gradients stay on this rank, unreduced, and the next ``step()``
                without ``accumulate`` (the last pass) reduces them once and
                divides them by the count of all the passes, so they are the
                plain model's for the loss over every pass's global batch
                (:mod:`pipe.distributed.accumulation`). Every rank passes the
                same value. Until that last pass an optimizer step over these
                parameters, :meth:`eval_step`, :meth:`forward` and
                :meth:`clip_grad_norm_` are refused.

        Returns:
            The mini-batch's loss (averaged over the data-parallel ranks, replicas
            and shards; with ``loss_reduction="count"`` the token mean over the
            global batch), on the rank of the last stage, or everywhere with
            ``broadcast_loss``; else None. The last pass of an accumulation
            returns the loss over all its passes; a pass with ``accumulate=True`` returns None.

        Raises:
            ValueError, TypeError: bad inputs or targets. If any rank fails, the
                failing rank re-raises its error and the others raise
                :class:`pipe.distributed.PipelineFailure` naming it (a failed pass
                drops the gradients of the accumulation it was part of).
        """
        if not isinstance(accumulate, bool):
            raise TypeError(f"step(accumulate=...) must be True or False, got {accumulate!r}")
        loss_fn = loss_fn or self.loss_fn
        window = self._accumulation
        batches, targets, weights = self._prepare(inputs, target, loss_fn, "step()", need_target=True,
                                                  summed=window is not None or accumulate)
        stop = checkpoint_stop(self.checkpoint, self.chunks) if torch.is_grad_enabled() else 0
        for bn in self._deferred_batch_norms:
            bn.discard()  # what a failed step left behind
        # "count": each micro-batch back-propagates its sum; the step divides by the count at the end.
        counted = CountedLoss(loss_fn) if self.loss_reduction == "count" and loss_fn is not None else None
        if window is None and (accumulate or self.loss_reduction == "count"):
            window = Accumulation(self, guard=accumulate)  # a "count" step alone is an accumulation of one pass
        self._accumulation = None
        try:
            with torch.enable_grad():
                loss, _ = self._runtime.run(batches, targets, counted or loss_fn, stop, weights, training=True,
                                            reduce=not accumulate)
        except BaseException:
            if window is not None:
                window.abandon()
            raise
        for bn in self._deferred_batch_norms:
            bn.commit()  # running statistics once per mini-batch
        if window is not None:
            window.add(loss, self._pass_count(counted, weights))
            if accumulate:
                self._accumulation = window
                return None
            loss = self._end_accumulation(window)
        self._tied.reduce_gradients()  # tied weights: the replicas' gradients summed over their ranks
        return self._share_loss(loss, broadcast_loss)

    def _pass_count(self, counted: Optional[CountedLoss], weights: Optional[list[float]]) -> Optional[Tensor]:
        """What a pass of an accumulation divides by, on the last stage's rank: its tokens ("count") or samples."""
        if counted is not None:
            return counted.total(self.device)
        if self.loss_reduction == "mean" and weights is not None:  # summed weights: the samples of each micro-batch
            return torch.tensor(sum(weights), dtype=torch.float64, device=self.device)
        return None

    def _end_accumulation(self, window: Accumulation) -> Optional[Tensor]:
        """The last pass is done (and reduced): the passes' gradients and loss divided by their global count."""
        window.release()
        if self.loss_reduction == "sum":
            window.gradients.finish(1.0)
            return window.loss
        return divide_step_by_count(window.local_count(self.device), window.loss, window.gradients, self.topology,
                                    self._last_stage_rank(), self._pipeline_group, self.device, is_last=self.is_last)

    def eval_step(self, inputs: Any = None, target: Any = None, loss_fn: Optional[LossFn] = None, *,
                  return_outputs: bool = False, broadcast_loss: bool = False) -> Any:
        """Runs one mini-batch forwards only, through this rank's schedule; returns the loss as :meth:`step` does.

        The micro-batches take the forward actions of the rank's program in
        the schedule's order, under ``torch.no_grad()``: nothing is
        checkpointed, no graph and no activation is kept, no gradient is
        touched. The loss is reduced as :meth:`step` reduces it
        (``loss_reduction``: averaged over the data-parallel ranks, or the global token mean), so it equals
        the plain model's loss under ``torch.no_grad()``. For a validation
        loss call ``model.eval()`` first (dropout off, BatchNorm's running
        statistics), as for the plain model. Every rank of the pipeline calls it.

        Args:
            inputs: what the first layer takes; used on the rank of the first stage.
            target: the loss function's second argument, on the rank of the last
                stage; without it no loss is computed (the outputs only).
            loss_fn: as for :meth:`step`; default the constructor's.
            return_outputs: also return the last stage's output for the whole
                mini-batch (on the last stage's rank; None elsewhere).
            broadcast_loss: return the loss on every rank of the pipeline
                (then every rank must agree on whether a target is given).

        Returns:
            The loss on the last stage's rank (None elsewhere, or without a
            target), or ``(loss, outputs)`` with ``return_outputs``.

        Raises:
            ValueError, TypeError: as :meth:`step`.
        """
        loss_fn = loss_fn or self.loss_fn
        batches, targets, weights = self._prepare(inputs, target, loss_fn, "eval_step()",
                                                  need_target=target is not None)
        counted = None
        if self.loss_reduction == "count" and targets is not None and loss_fn is not None:
            counted = CountedLoss(loss_fn)
        for bn in self._deferred_batch_norms:
            bn.discard()
        with torch.no_grad():
            loss, outputs = self._runtime.run(batches, targets, counted or loss_fn, 0, weights, training=False)
        for bn in self._deferred_batch_norms:
            bn.commit()
        if counted is not None:  # the sum of the sums over the whole (global) batch's count
            assert loss is not None
            local = torch.stack([loss.detach().double(), counted.total(loss.device)])
            if self.topology.data_parallel > 1:
                dist.all_reduce(local, group=self.topology.data_parallel_group)
            if local[1] <= 0:
                raise ValueError(f"loss_fn counted {float(local[1]):g} items over the whole batch (every target "
                                 "ignored?); the mean over them is undefined")
            loss = (local[0] / local[1]).to(loss.dtype)  # the same on every replica: no average to take
        loss = self._share_loss(loss, broadcast_loss, average=counted is None)
        if not return_outputs:
            return loss
        return loss, gather(outputs) if outputs else None

    def _prepare(self, inputs: Any, target: Any, loss_fn: Optional[LossFn], where: str,
                 need_target: bool, summed: bool = False,
                 ) -> tuple[Optional[list[Batch]], Optional[list[Batch]], Optional[list[float]]]:
        """This rank's input and target micro-batches and the loss weights. A bad argument on one rank must not
        leave the others waiting in the step: it is reported through the rank's failure channel (every rank
        then raises the same :class:`pipe.distributed.failure.PipelineFailure`; ``where`` names the call).
        ``summed``: a step of an accumulation, whose ``"mean"`` losses are weighted by their samples
        (:func:`pipe.distributed.loss.sample_weights`) for its last step to divide."""
        if self._accumulation is not None and where != "step()":
            raise self._accumulation.refuse(where)
        if self.awaiting_load:
            raise RuntimeError(
                f"{where} before the weights were loaded: this DistributedPipe was built with init_weights=False, "
                f"which leaves its tensors unset for a load to fill; call pipe.distributed.hf.load(directory, "
                f"model) or pipe.distributed.state.load(path, model) first, or build it with init_weights=True "
                f"(the default) to initialise the weights with the model's own code")
        failures = self._runtime.failures
        targets = weights = None
        try:  # a bad argument on one rank must not leave the others waiting: report it
            batches = None
            if self.is_first:
                verify_device(inputs, self.device, "an input", self._move_to("inputs"))
                batches = scatter_exactly(inputs, self.chunks, "inputs")
            if self.is_last and need_target:
                if loss_fn is None:
                    raise ValueError(f"the rank of the last stage needs loss_fn, in {where} or in the constructor")
                verify_device(target, self.device, "a target", self._move_to("target"))
                targets = scatter_exactly(target, self.chunks, "target")
                weights = sample_weights(self.loss_reduction, targets, summed)
                if not self._warned_ignored_targets:
                    self._warned_ignored_targets = warn_if_ignored_targets(self.loss_reduction, target)
        except (TypeError, ValueError) as error:
            failures.begin_step()  # the step the other ranks run
            raise failures.failure_from(where, error) from None
        if targets is not None and weights is not None and self.loss_reduction == "mean" and not summed \
                and self.topology.data_parallel > 1:
            try:  # replicas with uneven shares of the global batch: weighted by their samples
                weights = replica_share(weights, targets, self.topology.data_parallel_group,
                                        self.topology.data_parallel, self.device)
            except Exception as error:
                failures.begin_step()
                raise failures.failure_from(where, error) from None
        return batches, targets, weights

    def _move_to(self, what: str) -> str:
        return f"this rank's stages are on {self.device}; move it with {what}.to(pipe.device)"

    def _share_loss(self, loss: Optional[Tensor], broadcast_loss: bool, average: bool = True) -> Optional[Tensor]:
        return share_loss(loss, self.topology, self._last_stage_rank(), self._pipeline_group, self.device,
                          is_last=self.is_last, average=average, broadcast=broadcast_loss)

    def _last_stage_rank(self) -> int:
        return self.topology.global_rank(self.schedule.rank_of(self.schedule.stages - 1))

    def forward(self, *inputs: Any) -> Any:
        """Runs forwards only (no graph is kept): the output on the last stage's rank, None elsewhere.

        Every rank of the pipeline must call it; ``inputs`` matter on the first stage's rank.
        """
        batches, _, _ = self._prepare(pack_inputs(inputs) if inputs else None, None, None, "forward()",
                                      need_target=False)
        for bn in self._deferred_batch_norms:
            bn.discard()
        with torch.no_grad():
            _, outputs = self._runtime.run(batches, None, None, 0, None, training=False)
        for bn in self._deferred_batch_norms:
            bn.commit()
        return gather(outputs) if outputs else None

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clips the gradients of the whole pipeline to a global norm, like ``torch.nn.utils.clip_grad_norm_``.

        The norm is over every stage's gradients: sharded (``DTensor``)
        gradients, of FSDP or tensor parallelism, are summed over the mesh
        dimensions that shard them (one all-reduce per dimension), then
        everything over the pipeline ranks, so each rank scales by the same
        factor as a single process would. A tied weight counts once. Every
        rank must call it.

        Returns:
            The total norm before clipping, on every rank.

        Raises:
            RuntimeError: during an accumulation (``step(..., accumulate=True)``), whose gradients are not whole yet.
        """
        if self._accumulation is not None:
            raise self._accumulation.refuse("clip_grad_norm_()")
        return clip_grad_norm(self.parameters(), self._tied, self._pipeline_group, self.device, max_norm)
