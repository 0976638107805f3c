"""A candidate plan: what ``Pipe`` or ``DistributedPipe`` is told (schedule, chunks, balance, checkpoint mode,
per-stage recompute or offload, and the split of the ranks), and the arguments it becomes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pipe.core.schedule import Schedule
from pipe.plan.sharding import split_text

__all__: list[str] = []

AUTO = "auto"
AUTO_V = "auto-v"
AUTO_KINDS = (AUTO, AUTO_V)
"""The planner's schedule kinds for an order built from a plan's own stage costs: stage s on rank
``s % ranks`` (one or two stages per rank), or two stages per rank in a V (rank r: r and ``2 ranks - 1 - r``)."""


@dataclass(frozen=True)
class Candidate:
    """One plan: what ``Pipe`` or ``DistributedPipe`` is told.

    Attributes:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"`` or
            ``"zbv"`` (``Pipe`` runs GPipe); or ``"auto"`` / ``"auto-v"``: each
            rank's order built from this plan's own stage costs
            (:func:`pipe.schedule_from_costs`, with 1F1B's in-flight bound), its
            stages placed as interleaved places them (``"auto"``) or in a V like
            ZB-V's (``"auto-v"``), which :func:`pipe.plan.predict.predict` builds
            and times (``Prediction.schedule``).
        chunks: micro-batches per mini-batch.
        balance: layers per stage (``ranks x virtual_stages`` entries).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``.
        virtual_stages: stages per rank (interleaved and zbv).
        recompute: per stage, how many of its first layers are marked for
            full recompute (:func:`pipe.recompute.recompute`; a config
            ``{"recompute": [counts]}`` passed as ``recompute=``); empty: none.
            A per-stage choice between keeping everything and recomputing
            everything, as AdaPipe plans it.
        select: per stage, how many of its first layers are marked for
            selective recompute with the name regexes ``select_names``
            (:func:`pipe.recompute.select_recompute`; the config's
            ``select_recompute``); full recompute wins on a layer marked both,
            so layers ``recompute[s]`` to ``select[s]`` recompute selectively.
        select_names: the regexes of those marks (the profile's, ``Costs.select``).
        offload: per stage, how many of its first layers offload what they save
            for backward to host memory, prefetched one layer ahead
            (the config's ``swap_config.layer_swap``; :func:`pipe.recompute.offload`);
            empty: none. Only with ``checkpoint="never"``, no recompute marks, and
            not with the zero-bubble schedules.
        dp_shard: ranks each stage is sharded over with FSDP2 (the mesh's
            "dp_shard"; :mod:`pipe.plan.sharding`); the plan runs on
            ``ranks x dp_replicate x dp_shard`` ranks, each pipeline on
            B / (dp_replicate x dp_shard) samples.
        reshard_after_forward: with ``dp_shard > 1``, ``Shard(reshard_after_forward=...)``:
            True is ZeRO-3, False ZeRO-2.
        unit, reduce: with ``dp_shard > 1``, ``Shard(unit=..., reduce=...)``: ``"stage"`` gathers a
            stage whole for each run of its actions; ``"block"`` (ZeRO-3, a schedule whose backward is
            whole) each layer around its forward and its backward, the next one prefetched, its gradients
            reduce-scattered once a step (``reduce="step"``) or after each backward (``"micro-batch"``).
        dp_replicate: full replicas of each pipeline (the mesh's "dp_replicate"): their
            gradients averaged by the runner's averager, or with ``dp_shard > 1`` by FSDP
            (HSDP: sharded over "dp_shard", replicated over "dp_replicate").
    """

    schedule: str
    chunks: int
    balance: tuple[int, ...]
    checkpoint: str
    virtual_stages: int = 1
    recompute: tuple[int, ...] = ()
    dp_shard: int = 1
    reshard_after_forward: bool = True
    select: tuple[int, ...] = ()
    select_names: tuple[str, ...] = ()
    dp_replicate: int = 1
    offload: tuple[int, ...] = ()
    unit: str = "stage"
    reduce: str = "step"

    @property
    def blocks(self) -> str:
        """How FSDP gathers this plan's stages inside their actions, as :meth:`pipe.plan.Costs.stage_memory`
        counts it: ``""`` (a stage whole, or not sharded), or the ``reduce`` of a layer at a time."""
        return self.reduce if self.dp_shard > 1 and self.unit == "block" else ""

    def layout(self) -> Schedule:
        """A schedule that places this plan's stages on its ranks as it runs them: its own, or for an order
        built from the costs (:attr:`Prediction.schedule <pipe.plan.predict.Prediction>`) a fixed one with
        its placement (1F1B's, looped BFS's, ZB-V's)."""
        kind = {AUTO: "1f1b" if self.virtual_stages == 1 else "looped-bfs", AUTO_V: "zbv"}.get(
            self.schedule, self.schedule)
        return Schedule(kind, self.ranks, self.chunks, self.virtual_stages)

    @property
    def ranks(self) -> int:
        """Pipeline ranks (the mesh's "pp")."""
        return len(self.balance) // self.virtual_stages

    @property
    def parts(self) -> int:
        """Pipelines the mini-batch is split between: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks the plan runs on: ``ranks x dp_replicate x dp_shard``."""
        return self.ranks * self.parts

    def recomputed(self, stage: int) -> int:
        """Layers of ``stage`` marked for recompute."""
        return self.recompute[stage] if self.recompute else 0

    def selected(self, stage: int) -> int:
        """Layers of ``stage`` marked for selective recompute or more (the first ones recompute fully)."""
        return self.select[stage] if self.select else 0

    def offloaded(self, stage: int) -> int:
        """Layers of ``stage`` that offload to host memory."""
        return self.offload[stage] if self.offload else 0

    def selective(self) -> bool:
        """Whether some layer recomputes selectively (not covered by a full mark)."""
        return any(self.selected(s) > self.recomputed(s) for s in range(len(self.balance)))

    def recompute_config(self) -> Optional[dict[str, Any]]:
        """The ``recompute=`` config of ``Pipe``/``DistributedPipe`` for the per-stage counts (None: none); with
        ``offload``, its ``swap_config`` (layer indices: recompute marks and offload are not planned together)."""
        config: dict[str, Any] = {}
        if any(self.recompute):
            config["recompute"] = list(self.recompute)
        if self.selective():
            config["select_recompute"] = {name: list(self.select) for name in self.select_names}
        if any(self.offload):
            firsts = [sum(self.balance[:s]) for s in range(len(self.balance))]
            layers = [first + k for first, count in zip(firsts, self.offload) for k in range(count)]
            return {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": layers}]}}
        return {"recompute_config": config} if config else None

    def distributed_kwargs(self) -> dict[str, Any]:
        """Arguments of ``DistributedPipe(model, **kwargs)``; with ``dp_shard > 1`` also ``shard=Shard(...)``,
        and the model needs ``mesh=make_mesh(**candidate.mesh_kwargs())`` too."""
        kwargs: dict[str, Any] = {"chunks": self.chunks, "balance": list(self.balance), "checkpoint": self.checkpoint,
                                  "schedule": self.schedule, "virtual_stages": self.virtual_stages}
        if self.recompute_config() is not None:
            kwargs["recompute"] = self.recompute_config()
        if self.dp_shard > 1:
            from pipe.distributed.fsdp import Shard

            # Gathered as the planner counts it (pipe.plan.sharding).
            kwargs["shard"] = Shard(reshard_after_forward=self.reshard_after_forward, unit=self.unit,
                                    reduce=self.reduce)
        return kwargs

    def mesh_kwargs(self) -> dict[str, int]:
        """Arguments of ``pipe.distributed.make_mesh(**kwargs)``: ``{"pp": ranks, "dp_shard": dp_shard}``,
        and ``"dp_replicate"`` when the plan has replicas.

        The mesh is collective: every rank calls ``make_mesh`` after
        ``init_process_group``; each rank then passes its share of the
        mini-batch (part ``model.topology.replica`` of ``model.topology.data_parallel``).
        """
        kwargs = {"pp": self.ranks, "dp_shard": self.dp_shard}
        if self.dp_replicate > 1:
            kwargs["dp_replicate"] = self.dp_replicate
        return kwargs

    def describe(self) -> str:
        extra = f" v={self.virtual_stages}" if self.virtual_stages > 1 and self.schedule != "zbv" else ""
        marks = f" recompute={list(self.recompute)}" if any(self.recompute) else ""
        marks += f" select={list(self.select)}" if self.selective() else ""
        marks += f" offload={list(self.offload)}" if any(self.offload) else ""
        split = f" {split_text(self)}" if self.parts > 1 else ""
        return (f"{self.schedule}{extra} chunks={self.chunks} balance={list(self.balance)} "
                f"checkpoint={self.checkpoint}{marks}{split}")
