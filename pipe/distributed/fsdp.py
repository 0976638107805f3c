"""FSDP2-sharded stages, driven by the pipeline runner.

``DistributedPipe(..., mesh=make_mesh(pp=2, dp_shard=2), shard=Shard())``
wraps each of this rank's stages with torch's ``fully_shard`` over the mesh's
"dp_shard" dimension (HSDP over ("dp_replicate", "dp_shard") when the mesh
has both): first the modules ``Shard.blocks`` chooses (by default each layer of
the stage; the policy sees the plain model's names), then the stage itself. Parameters,
gradients and optimizer state are then ``DTensor`` shards.

With ``unit="stage"`` (ZeRO-2's, and the zero-bubble schedules') the runner
drives the gathers. FSDP's own hooks would gather and reduce once per
micro-batch; a pipeline can do with fewer, since it knows the rank's whole program for the step
(:meth:`pipe.core.schedule.Schedule.actions`), so the lowering of that program places the gathers, reduces and reshards
(:func:`pipe.core.lowering.gathers`) and :class:`StageSharding` executes them,
as torch's ``PipelineStage`` does:

* a stage is gathered (``unshard``, asynchronous) before its first action of
  the step, and the next stage of the program is prefetched while the current one computes;
* its gradients are reduce-scattered once, right after its last backward of
  the step (the last ``W`` in a zero-bubble schedule), and the stage is resharded
  then, so its full parameters and gradients are freed while the rank's other stages still run;
* ``reshard_after_forward=True`` (ZeRO-3) also reshards a stage whenever the
  program moves on to another stage (so a rank holds one stage gathered, two
  while the next is prefetched), ``False`` (ZeRO-2) keeps it gathered until its last action.

Within a run of one stage's actions the stage stays gathered (FSDP's per-block
reshard after forward is turned off), so a stage is gathered once per run of
its actions, not once per micro-batch.

``Shard(unit="block")``, the default under ZeRO-3 where the schedule's
backward is whole (:meth:`Shard.with_unit`), trades traffic for memory, as
torchtitan's per-block FSDP2 does: each block (a layer of the stage; a decoder layer, an untied
embedding, the final norm or the head of a model cut by :func:`pipe.split`,
see :mod:`pipe.split_blocks`) is gathered by FSDP's own hooks around its
forward and its backward, one at a time with the next prefetched, and
resharded after each, unless the rank's next action starts with it (a stage's
last block from a forward to its backward, its first from a backward to a
forward: :meth:`StageSharding.entering`); its gradients accumulate unsharded until the one
reduce-scatter of the step (or, ``reduce="micro-batch"``, are reduced after
each backward). The runner still gathers what the stage holds outside its
blocks (a tied embedding) as above. A rank then
holds its shards, the stage's unsharded gradients, one or two gathered blocks
and the activations, instead of its whole stage gathered. On the CPU a block of
one parameter (an untied embedding, the head) is gathered straight into its
parameter, without FSDP2's buffer and copy (:class:`_IntoParameter`).

Each gather on the CPU writes into memory the kernel hands out afresh, a page
at a time: in 4 KiB pages unless the process asked for 2 MiB ones, which torch
does for its tensors of 2 MiB or more only with ``THP_MEM_ALLOC_ENABLE=1`` in
the environment before it starts (the kernel's ``madvise`` mode of transparent
huge pages, most distributions' default). :func:`advise_huge_pages` says so
once where the units are large enough for it to matter; the launchers in
``launch/`` set it.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, cast

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, UnshardHandle, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from pipe.core.lowering import Kind, Step
from pipe.core.options import REDUCES, UNITS
from pipe.core.original_names import partition_name
from pipe.core.units import format_bytes

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: Units of this many bytes or more take most of a CPU gather's time in page faults without huge pages.
HUGE_PAGE_UNIT_BYTES = 32 * 1024 * 1024

#: The kernel's setting of transparent huge pages; ``[madvise]`` marks its mode.
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"

BlockPolicy = Callable[[str, nn.Module], bool]
#: The steps :meth:`StageSharding.entering` is told of.
ENTERED = frozenset({Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD})


@dataclass(frozen=True)
class Shard:
    """How ``DistributedPipe`` shards its stages with FSDP2 (``fully_shard``).

    Args:
        reshard_after_forward: ``True`` (ZeRO-3): a stage's full parameters are
            freed whenever the rank's program moves to another stage (one stage
            gathered, two during a prefetch); ``False`` (ZeRO-2): kept from the stage's first
            action of the step to its last. Both reduce-scatter gradients once
            per step and hold only shards between steps.
        mp_policy: FSDP's ``MixedPrecisionPolicy`` (default: full precision).
        blocks: ``blocks(name, module) -> bool`` chooses the modules of a stage
            that get their own ``fully_shard`` (names are the plain model's, as
            in ``state_dict()``: ``"3"``, ``"3.attn"``; in a model cut by
            :func:`pipe.split`, the split model's module paths, ``"model.layers.0"``,
            and a piece of the split, which the model has no module for, by its
            index ``"0"``); default: each layer of the stage that has parameters
            (each piece of a split model), but one holding a weight tied to
            another layer of the stage (a tied split model's head at pipeline
            size 1), which stays in the stage's group: FSDP cannot put one
            parameter in two groups, and blocks of one's own that would are
            refused. The stage itself is always wrapped last.
            ``Shard(blocks=lambda name, module: False)`` wraps only the stage:
            one group, as a stage is gathered whole anyway.
        unit: what is gathered at a time under ZeRO-3. ``"block"``: each
            block around its own forward and backward, the next prefetched
            (least memory: the default blocks are then the layers a stage
            calls, a split model's decoder layers); needs
            ``reshard_after_forward=True`` and a schedule whose backward is
            whole. ``"stage"``: a stage whole, once per run of its actions
            (least traffic; with one stage a rank, gathered for the whole
            step). Default (None): ``"block"`` under ZeRO-3 where the
            schedule allows it, else ``"stage"`` (ZeRO-2; the zero-bubble
            schedules, whose backward is split in two).
        reduce: when a block's gradients are reduce-scattered. ``"step"``: once,
            after the stage's last backward of the step (the stage's gradients
            held unsharded until then; least traffic). ``"micro-batch"`` (with
            ``unit="block"``): after each backward of the block, added to the
            sharded gradient, so no unsharded gradient outlives its block's
            backward (least memory; a reduce-scatter per block per micro-batch).
        reshard_after_backward: with ``unit="block"`` and ``reduce="step"``:
            ``True`` (default) frees a block's full parameters after each of
            its backwards; ``False`` keeps them from its first backward of the
            step until the stage's reduce, as torch's ``PipelineStage`` does
            under FSDP2: its later backwards gather nothing (a forward between
            them still gathers and frees), for the stage's full parameters
            held through the backwards.
        prefetch: with ``unit="block"``: ``True`` (default) gathers the next
            block while one computes, forward and backward (FSDP's prefetch);
            ``False`` gathers each block only when it runs: a block's gather
            no longer overlaps the block before it, and no block is gathered
            beside the one computing, nor its gather buffer beside a new
            gradient (least memory, slower where the gathers took the time of
            the compute they overlapped).
    """

    reshard_after_forward: bool = True
    mp_policy: Optional[MixedPrecisionPolicy] = None
    blocks: Optional[BlockPolicy] = None
    unit: Optional[str] = None
    reduce: str = "step"
    reshard_after_backward: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"Shard(reshard_after_forward=...) must be True or False, got {self.reshard_after_forward!r}")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"Shard(mp_policy=...) must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                f"{type(self.mp_policy).__name__}"
            )
        if self.blocks is not None and not callable(self.blocks):
            raise TypeError(f"Shard(blocks=...) must be a function (name, module) -> bool, got {self.blocks!r}")
        if self.unit is not None and self.unit not in UNITS:
            raise ValueError(f"Shard(unit=...) must be one of {UNITS} or None (the default), got {self.unit!r}")
        if self.reduce not in REDUCES:
            raise ValueError(f"Shard(reduce=...) must be one of {REDUCES}, got {self.reduce!r}")
        if self.unit == "block" and not self.reshard_after_forward:
            raise ValueError(
                "Shard(unit='block', reshard_after_forward=False): ZeRO-2 keeps a stage gathered from its first "
                "action to its last, so there is nothing to gather block by block; pass reshard_after_forward=True "
                "(ZeRO-3) to gather one block at a time, or unit='stage'"
            )
        unit = self._unit(splits_backward=False)  # what it will be where the schedule allows blocks
        got = repr(self.unit) if self.unit is not None else "'stage', ZeRO-2's"
        if self.reduce == "micro-batch" and unit != "block":
            raise ValueError(
                f"Shard(reduce='micro-batch') needs unit='block' (got unit={got}): a stage gathered whole "
                f"keeps its gradients unsharded until its last backward anyway; pass Shard(unit='block', "
                f"reduce='micro-batch') (ZeRO-3) to reduce each layer's gradients after each of its backwards"
            )
        if not isinstance(self.reshard_after_backward, bool):
            raise TypeError(f"Shard(reshard_after_backward=...) must be True or False, got "
                            f"{self.reshard_after_backward!r}")
        if not self.reshard_after_backward and (unit != "block" or self.reduce != "step"):
            raise ValueError(
                f"Shard(reshard_after_backward=False) goes with unit='block' and reduce='step' (got "
                f"unit={got}, reduce={self.reduce!r}): a stage gathered whole stays gathered through its "
                f"run of actions anyway, and reducing after each backward reshards the block then; pass "
                f"Shard(unit='block', reshard_after_backward=False)"
            )
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"Shard(prefetch=...) must be True or False, got {self.prefetch!r}")
        if not self.prefetch and unit != "block":
            raise ValueError(
                f"Shard(prefetch=False) goes with unit='block' (got unit={got}): a stage gathered whole is gathered "
                f"once per run of its actions, and the runner's prefetch of the next stage is the schedule's; pass "
                f"Shard(unit='block', prefetch=False) to gather each layer only when it runs"
            )

    def per_layer(self) -> list[str]:
        """The settings given that gather a layer at a time: ``unit="block"``, and those that need it
        (``reduce="micro-batch"``, ``prefetch=False``, ``reshard_after_backward=False``), as ``"name=value"``."""
        needed = [("reduce", self.reduce, "step"), ("prefetch", self.prefetch, True),
                  ("reshard_after_backward", self.reshard_after_backward, True)]
        return ([f"unit={self.unit!r}"] if self.unit == "block" else []) + [
            f"{name}={value!r}" for name, value, default in needed if value != default]

    def with_unit(self, schedule: object, splits_backward: bool) -> "Shard":
        """This configuration with its unit chosen for ``schedule`` (``unit=None``: ``"block"`` under ZeRO-3 where
        the schedule's backward is whole, else ``"stage"``).

        Raises:
            ValueError: ``unit="block"`` (given, or needed by ``reduce="micro-batch"``, ``prefetch=False`` or
                ``reshard_after_backward=False``) with a schedule that splits each backward in two.
        """
        asked = self.per_layer()
        implied = any(not setting.startswith("unit=") for setting in asked)
        if splits_backward and asked:
            raise ValueError(
                f"shard=Shard(unit='block') with schedule {schedule!r}, which splits each backward into an input "
                f"half and a later weight half: FSDP's hooks reshard a layer after its input half, and the weight "
                f"half would miss its gathered weights; use Shard(unit='stage') with this schedule"
                f"{' (without reduce=, prefetch= or reshard_after_backward=, which need unit=block)' if implied else ''}"
                f", or a schedule whose backward is whole ('1f1b', 'gpipe', 'interleaved', 'looped-bfs')"
            )
        return self if self.unit is not None else replace(self, unit=self._unit(splits_backward))

    def _unit(self, splits_backward: bool) -> str:
        """The unit given, else ``"block"`` under ZeRO-3 where the schedule's backward is whole, else ``"stage"``
        (ZeRO-2 gathers a stage whole)."""
        if self.unit is not None:
            return self.unit
        return "block" if self.reshard_after_forward and not splits_backward else "stage"


def refuse_wrapped(model: nn.Module, what: str = "the model") -> None:
    """Raises if a module of ``model`` is already an FSDP module (the runner must own the wrapping).

    Raises:
        ValueError: naming the module and the fix.
    """
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise ValueError(
                f"module {name or '(the root)'!r} of {what} is already wrapped with fully_shard; "
                f"DistributedPipe shards its stages itself (shard=Shard(...)) so that the runner can "
                f"gather and reduce them once per step: pass the unwrapped model and choose the "
                f"wrapped modules with Shard(blocks=...)"
            )


def _refuse_strided_first_dim(param: nn.Parameter, name: str) -> None:
    """Refuses a weight that tensor parallelism split part by part along dimension 0 (a fused q, k, v
    ``nn.Linear``), which FSDP2 would shard along dimension 0 again: DTensor cannot describe the result."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim % param.dim() == 0
                                          for p in param.placements):
        raise ValueError(
            f"parameter {name!r} is split by tensor parallelism part by part along its first dimension (a fused "
            f"q, k, v linear layer), and FSDP2 shards the first dimension too: DTensor cannot describe the result, "
            f"so its checkpoints would be wrong; leave it out of the tensor-parallel plan, or train this model "
            f"without dp_shard")


def _default_blocks(stage: nn.Module, unit: str) -> BlockPolicy:
    """Each layer of the stage with parameters; by block, the modules a graph of the stage calls where it has
    such (a split stage's outlined decoder layers, :mod:`pipe.split_blocks`). A layer holding a weight tied to
    one outside it (a tied LM head, where the embedding is in the same stage) is left to the stage's own group:
    FSDP cannot put one parameter in two groups."""
    uses = Counter(id(param) for _, param in stage.named_parameters(remove_duplicate=False))

    def untied(module: nn.Module) -> bool:
        inside = Counter(id(param) for _, param in module.named_parameters(remove_duplicate=False))
        return bool(inside) and all(uses[key] == count for key, count in inside.items())

    layers = {id(m) for m in _graph_calls(stage) if untied(m)} if unit == "block" else set()
    if not layers:
        layers = {id(m) for m in stage.children() if untied(m)}
    return lambda name, module: id(module) in layers


def gathered_blocks(stage: nn.Module) -> list[nn.Module]:
    """The blocks of ``stage`` that FSDP's own hooks gather one at a time under ``Shard(unit="block")`` with the
    default blocks, in the order its forward calls them (what :mod:`pipe.plan.profile` counts them by)."""
    default = _default_blocks(stage, "block")
    chosen = [module for name, module in stage.named_modules() if name and default(name, module)]
    ordered: list[nn.Module] = []
    for called in _calls(stage):
        if any(called is block for block in chosen) and not any(called is block for block in ordered):
            ordered.append(called)
    return ordered


def _graph_calls(stage: nn.Module) -> list[nn.Module]:
    """The modules that the ``fx`` graphs in ``stage`` call (``call_module``), in order."""
    return [graph_module.get_submodule(str(node.target)) for graph_module in stage.modules()
            if isinstance(graph_module, fx.GraphModule) for node in graph_module.graph.nodes
            if node.op == "call_module"]


def _calls(stage: nn.Module) -> list[nn.Module]:
    """The modules ``stage``'s forward calls, so that FSDP's hooks on them run, in order: what its ``fx`` graph
    calls; or, for a stage that calls its layers, each layer followed by what the layer's graphs call. The
    other modules of a graph (a split stage's holders of weights) are only read by it."""
    if isinstance(stage, fx.GraphModule):
        return _graph_calls(stage)
    return [called for child in stage.children() for called in (child, *_graph_calls(child))]


def _called(stage: nn.Module, module: nn.Module) -> bool:
    """Whether ``stage``'s forward calls ``module`` (:func:`_calls`)."""
    return any(module is called for called in _calls(stage))


def shard_stages(stages: dict[int, nn.Module], config: Shard, mesh: DeviceMesh) -> None:
    """Wraps every stage of this rank with ``fully_shard`` over ``mesh`` (the blocks first, in place).

    Raises:
        ValueError: a module of a stage is already an FSDP module, or a
            parameter is shared by two blocks or two stages of this rank (FSDP
            would shard it twice).
    """
    assert config.unit is not None, "Shard.with_unit chooses the unit before the stages are sharded"
    stage_of: dict[int, tuple[int, str]] = {}
    for s, stage in sorted(stages.items()):
        refuse_wrapped(stage, f"stage {s}")
        owner: dict[int, tuple[str, str]] = {}  # parameter -> (its name in the stage, the block holding it first)
        if config.blocks is None:
            default = _default_blocks(stage, config.unit)
            chosen = [(name, module) for name, module in stage.named_modules() if name and default(name, module)]
        else:
            chosen = [(name, module) for name, module in stage.named_modules()
                      if name and config.blocks(partition_name(stage, name, module=True), module)]
        for block_name, block in chosen:
            for pname, param in block.named_parameters():
                plain = partition_name(stage, f"{block_name}.{pname}")
                if id(param) in owner and not owner[id(param)][0].startswith(f"{block_name}."):
                    blocks = f"{partition_name(stage, owner[id(param)][1], module=True)!r} and " \
                             f"{partition_name(stage, block_name, module=True)!r}"
                    raise ValueError(
                        f"parameter {plain!r} is held by two blocks of stage {s}, {blocks} (a tied weight): FSDP "
                        f"cannot shard one parameter in two groups; pass Shard(blocks=lambda name, module: False) "
                        f"to shard the stage as one group, or choose blocks (Shard(blocks=...)) that keep both "
                        f"uses in one block, or put the two uses on different pipeline ranks"
                    )
                owner.setdefault(id(param), (f"{block_name}.{pname}", block_name))
        names = [block_name for block_name, _ in chosen]
        for pname, param in stage.named_parameters(remove_duplicate=False):
            if id(param) in owner and not any(pname.startswith(f"{name}.") for name in names):
                block = partition_name(stage, owner[id(param)][1], module=True)
                raise ValueError(
                    f"parameter {partition_name(stage, owner[id(param)][0])!r} of block {block!r} of stage {s} is "
                    f"also held outside the stage's blocks (a tied weight): FSDP cannot shard one parameter in two "
                    f"groups, the block's and the stage's; leave {block!r} "
                    f"out of Shard(blocks=...) so that the weight stays in the stage's group, or pass "
                    f"Shard(blocks=lambda name, module: False) to shard the stage as one group"
                )
        for pname, param in stage.named_parameters():
            _refuse_strided_first_dim(param, partition_name(stage, pname))
            other = stage_of.setdefault(id(param), (s, partition_name(stage, pname)))
            if other[0] != s:
                raise ValueError(
                    f"parameter {other[1]!r} is held by stages {other[0]} and {s} of this rank (a tied weight), "
                    f"and FSDP cannot shard one parameter for two stages; place the stages on different pipeline "
                    f"ranks (another schedule or pipeline size), or untie the weights"
                )
        mp_policy = config.mp_policy or MixedPrecisionPolicy()
        # Innermost first: fully_shard of a parent leaves the parameters of wrapped children to them.
        by_block = [block for _, block in chosen if config.unit == "block" and _called(stage, block)]
        for _, block in reversed(chosen):
            fully_shard(block, mesh=mesh, reshard_after_forward=any(block is b for b in by_block), mp_policy=mp_policy)
        fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
        # Each block prefetches the next in the forward (after its own gather's buffer is freed) and the one
        # before in the backward. FSDP's own backward order is guessed from the forwards, which a pipeline
        # interleaves: it gathered the head again after the last backward of a step, for nothing. A block told
        # itself (gathered already) prefetches nothing.
        for block, following in zip(by_block, by_block[1:] + [None]):
            assert isinstance(block, FSDPModule)
            cast(nn.Module, block).register_forward_pre_hook(
                _BeforeForward(following if config.prefetch else None))
            if config.prefetch and following is not None:
                assert isinstance(following, FSDPModule)
                following.set_modules_to_backward_prefetch([block])
        for block in by_block if not config.prefetch else by_block[:1]:
            assert isinstance(block, FSDPModule)
            block.set_modules_to_backward_prefetch([block])
        in_place = [m for m in [block for _, block in chosen] + [stage] if _gather_in_place(m)]
        logger.info("stage %d: fully_shard on %d block(s) (%d gathered by their own hooks) and the stage, mesh %s; "
                    "%d unit(s) of one parameter gathered straight into it", s, len(chosen), len(by_block), mesh,
                    len(in_place))
        _quiet_view_warning([stage] + [block for _, block in chosen if not any(block is b for b in by_block)])
        units = [block for _, block in chosen] or [stage]
        advise_huge_pages(mesh.device_type, max(sum(p.numel() * p.element_size() for p in unit.parameters())
                                                for unit in units))


_huge_pages_advised = False


def advise_huge_pages(device_type: str, largest: int) -> bool:
    """Warns once per process (on rank 0) where FSDP gathers units of up to ``largest`` bytes on the CPU into
    4 KiB pages though the kernel gives 2 MiB ones to a process that asks (``THP_MEM_ALLOC_ENABLE`` not 1, the
    kernel's transparent huge pages in ``madvise`` mode). Returns whether it warned."""
    global _huge_pages_advised
    if (device_type != "cpu" or largest < HUGE_PAGE_UNIT_BYTES or _huge_pages_advised
            or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"):
        return False
    try:
        with open(THP_MODE_FILE) as file:
            mode = file.read()
    except OSError:  # not Linux, or no transparent huge pages
        return False
    if "[madvise]" not in mode or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return False
    _huge_pages_advised = True
    logger.warning(
        "FSDP gathers units of up to %s on the CPU into memory the kernel hands out in 4 KiB pages; it gives 2 MiB "
        "pages (transparent huge pages, mode madvise here) to a process that asks, which torch does only with "
        "THP_MEM_ALLOC_ENABLE=1 in the environment before it starts: set it (the launchers in launch/ do) for "
        "gathers in about half the time (docs/distributed_training.md)", format_bytes(largest))
    return True


def _quiet_view_warning(wrapped: list[nn.Module]) -> None:
    """Hides FSDP's "returned a view tensor" warning for the modules whose gathers the runner drives, and logs
    why once.

    FSDP warns that an in-place op on a wrapped module's view output drops its pre-backward hook, and with
    it the gather of the parameters for backward. A stage, and its blocks under ``unit="stage"``, do not rely on
    that hook: :class:`StageSharding` gathers each stage before every one of its actions and reduce-scatters
    explicitly, so the gradients stay exact (tests/distributed/test_fsdp_ranks.py changes a stage's output in
    place). Blocks gathered by their own hooks (``unit="block"``) keep the warning: there the skipped gather
    fails the backward, and ``unit="stage"`` is the fix. Other modules keep it too.
    """
    names = sorted({type(module).__name__ for module in wrapped})
    for name in names:
        warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({re.escape(name)}\) returned a view tensor",
                                category=UserWarning)
    logger.info("FSDP's 'returned a view tensor' warning is hidden for %s: the runner gathers each stage before "
                "every action and reduces explicitly, so an in-place op on a stage's output cannot skip a gather",
                ", ".join(names))


class StageSharding:
    """Gathers, reduces and reshards this rank's FSDP stages as its program runs.

    Args:
        stages: this rank's stages by index, each wrapped by :func:`shard_stages`.
        config: the ``Shard`` configuration.
        last_stage: the pipeline's last stage (the one that computes the loss), here or on another rank.
    """

    def __init__(self, stages: dict[int, nn.Module], config: Shard, last_stage: int) -> None:
        assert config.unit is not None, "Shard.with_unit chooses the unit before the stages are sharded"
        self.config = config
        self.modules: dict[int, list[FSDPModule]] = {
            s: [m for m in stage.modules() if isinstance(m, FSDPModule)] for s, stage in stages.items()}
        # Blocks that FSDP's own hooks gather (unit="block"); the runner gathers the others.
        self.by_block: dict[int, list[FSDPModule]] = {
            s: [m for m in self.modules[s]
                if config.unit == "block" and m is not stage and isinstance(m, nn.Module) and _called(stage, m)]
            for s, stage in stages.items()}
        self.by_runner: dict[int, list[FSDPModule]] = {
            s: [m for m in self.modules[s] if not any(m is b for b in self.by_block[s])] for s in stages}
        # The blocks a stage calls first and last stay gathered across the boundary between two of its actions
        # that use them one after the other, where FSDP's hooks would reshard them and gather them again at once:
        # * the last block, from a forward that builds a graph to its backward. The loss stage's (an LM head)
        #   always, as FSDP2 leaves its root module: its backward follows such a forward (at once, after the
        #   loss, in 1F1B; after the other forwards in GPipe), one gather of it per micro-batch where its
        #   backward gathered it again. Another stage's where the rank's next action is that backward (1F1B's
        #   steady state), or a checkpointed forward's replay is (the backward follows it). A checkpointed
        #   forward (no graph) reshards it: its replay comes later, with the backward.
        # * the first block (reduce="step"), from a backward to the forward that is the rank's next action.
        # Either is the one block computing at the boundary (the other one gathered is the next's prefetch), so
        # no more is held than within an action.
        self._training = False
        self._ends: dict[int, tuple[FSDPModule, FSDPModule]] = {}
        self._then_backward: dict[int, bool] = {}
        self._following: dict[Step, Optional[Step]] = {}
        for s, stage in stages.items():
            called = [b for m in _calls(stage) for b in self.by_block[s] if m is b]
            if not called:
                continue
            self._ends[s] = (called[0], called[-1])
            self._then_backward[s] = False
            cast(nn.Module, called[-1]).register_forward_pre_hook(_HeldToBackward(self, s, s == last_stage))
        self.roots: dict[int, FSDPModule] = {}
        for s, stage in stages.items():
            assert isinstance(stage, FSDPModule)
            self.roots[s] = stage
        self._handles: dict[int, list[UnshardHandle]] = {}
        self._gathered: set[int] = set()

    # -- the plan of one step ------------------------------------------------------------------

    def begin_step(self, training: bool, program: Sequence[Step] = ()) -> None:
        """Sets FSDP's flags so its hooks neither reduce nor reshard; the runner does both.

        (Resharding after forward is off since :func:`shard_stages`, except for blocks gathered by their own
        hooks, and for the loss stage's last block only outside training and checkpointed forwards.) When to
        gather, reduce and reshard is the lowered program's (:func:`pipe.core.lowering.gathers`). ``program``:
        the rank's lowered program for the step, for the blocks kept gathered from one action to the next
        (:meth:`entering`).
        """
        self._training = training
        runs = [step for step in program if step.kind in ENTERED]
        self._following = dict(zip(runs, [*runs[1:], None]))
        for s in self._then_backward:
            self._then_backward[s] = False
        for s, modules in self.modules.items():
            for module in modules:
                # A block gathered by its hooks is resharded after each backward (unless reshard_after_backward
                # is off: then at the stage's reduce), its gradient kept unsharded until the stage's reduce, or
                # reduce-scattered then (reduce="micro-batch").
                by_block = any(module is b for b in self.by_block[s])
                module.set_reshard_after_backward(by_block and self.config.reshard_after_backward, recurse=False)
                module.set_requires_gradient_sync(by_block and self.config.reduce == "micro-batch", recurse=False)
                module.set_is_last_backward(False)

    def entering(self, step: Step) -> None:
        """Before a step of the kinds in ``ENTERED`` (a forward, a checkpointed cell's replay, a backward):
        whether the stage's last block stays gathered from this forward or replay to the backward that follows
        it on the rank, and its first block from this backward to the forward that follows it."""
        s = step.stage
        if not self._training or s not in self._ends:
            return
        following = self._following.get(step)
        then = following.kind if following is not None and following.stage == s else None
        # After a forward, a backward that replays its forward first starts with its first block: not held then.
        self._then_backward[s] = step.kind is Kind.RECOMPUTE or (step.kind is Kind.FORWARD and then is Kind.BACKWARD)
        if step.kind is Kind.BACKWARD and self.config.reduce == "step":
            self._ends[s][0].set_reshard_after_backward(
                self.config.reshard_after_backward and then is not Kind.FORWARD, recurse=False)

    def executors(self) -> dict[Kind, Callable[[Step], None]]:
        """The runner's executors of the FSDP steps of a lowered program."""
        return {Kind.UNSHARD: lambda step: self.unshard(step.stage),
                Kind.WAIT_UNSHARD: lambda step: self.wait(step.stage),
                Kind.REDUCE_GRAD: lambda step: self.reduce(step.stage),
                Kind.RESHARD: lambda step: self.reshard(step.stage)}

    def unshard(self, stage: int) -> None:
        """Starts gathering ``stage``'s parameters (returns at once)."""
        self._handles[stage] = [h for m in self.by_runner[stage] if (h := m.unshard(async_op=True)) is not None]
        self._gathered.add(stage)

    def wait(self, stage: int) -> None:
        """Waits for ``stage``'s gather."""
        for handle in self._handles.pop(stage, []):
            handle.wait()

    def reduce(self, stage: int) -> None:
        """Reduce-scatters ``stage``'s accumulated gradients once (its last backward of the step is done)."""
        root = self.roots[stage]
        for module in self.modules[stage]:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_is_last_backward(True)
        state = root._get_fsdp_state()  # fully_shard's state, or that of torch's FSDP-based replicate
        for fsdp_state in state._state_ctx.all_states:
            for group in _param_groups(fsdp_state):
                group.post_backward()
        state._root_post_backward_final_callback()

    def reshard(self, stage: int) -> None:
        """Frees ``stage``'s full parameters (waits for a gather still in flight first)."""
        for handle in self._handles.pop(stage, []):
            handle.wait()
        for module in self.modules[stage]:
            module.reshard()
        self._gathered.discard(stage)

    def abandon(self) -> None:
        """After a failed step: waits for gathers in flight and reshards everything (blocks kept gathered
        across actions too).

        A gather whose partner is gone fails too; that is the step's failure,
        already reported, so it is logged and the stage resharded all the same.
        """
        for s in list(self._gathered):
            try:
                self.reshard(s)
            except Exception:
                logger.debug("resharding stage %d after a failed step", s, exc_info=True)
                self._handles.pop(s, None)
                self._gathered.discard(s)
        for s, modules in self.modules.items():
            for module in modules:
                try:
                    module.reshard()
                except Exception:
                    logger.debug("resharding a module of stage %d", s, exc_info=True)


class _HeldToBackward:
    """Before a stage's last block's forward: whether FSDP keeps it gathered after it, for the backward that
    uses it next (:class:`StageSharding`)."""

    def __init__(self, sharding: StageSharding, stage: int, loss_stage: bool) -> None:
        self.sharding, self.stage, self.loss_stage = sharding, stage, loss_stage

    def __call__(self, module: nn.Module, args: Any) -> None:
        sharding = self.sharding
        held = sharding._training and torch.is_grad_enabled() and (
            self.loss_stage or sharding._then_backward[self.stage])
        cast(FSDPModule, module).set_reshard_after_forward(not held, recurse=False)


class _BeforeForward:
    """After FSDP's pre-forward has gathered a block: frees the buffer the gather arrived in (on the CPU), then
    starts gathering the next block (FSDP's forward prefetch, one buffer later).

    In a forward, FSDP2 keeps the buffer of a block's all-gather (as large as
    the block) until the next gather, so that on a GPU the copy out of it can
    overlap that gather on another stream. The CPU has no streams and copied it
    out already: the buffer would only sit beside the block through its forward
    (an LM head's beside its logits) and, for the last block, until the next
    micro-batch. FSDP's own forward prefetch starts the next gather before this
    hook runs, so the block, its buffer and the next block's buffer were held at
    once; prefetching here holds two.
    """

    def __init__(self, following: Optional[FSDPModule]) -> None:
        self.following = following

    def __call__(self, module: nn.Module, args: Any) -> None:
        state = cast(FSDPModule, module)._get_fsdp_state()
        if state._device.type == "cpu":
            state._comm_ctx.all_gather_state = None
        # A forward replayed in a backward (FSDP's PRE_BACKWARD state) is gathered by the backward's hooks.
        if self.following is not None and state._training_state == TrainingState.FORWARD:
            for group in _param_groups(self.following._get_fsdp_state()):
                FSDPParamGroup._prefetch_unshard(group, "forward")


class _IntoParameter(DefaultAllGather):
    """FSDP2's all-gather of a unit of one parameter on the CPU, arriving in the parameter's own storage.

    FSDP2 gathers a unit into a buffer of its own and then copies the buffer
    into the unsharded parameters, so for a moment the unit is held twice
    (an LM head or an untied embedding: the largest units of a LLaMA's
    stages), and each gather copies all of it once more. With one
    parameter sharded on dim 0, the buffer's layout (each rank's padded
    shard in rank order) is the unsharded parameter's, so the buffer can be
    the parameter's storage: the gather writes there and the copy is of each
    element onto itself. The values are the same bytes; only the second copy
    is gone. On a GPU the buffer is kept for the next gather's overlap on
    another stream, so the default gather stays there.
    """

    def __init__(self, fsdp_param: Any) -> None:
        self._param = fsdp_param

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        world_size = self._param.mesh_info.shard_mesh_size
        numel = int(size[0]) // world_size
        self._param.init_all_gather_outputs([numel], [dtype], world_size, device)
        out = self._param.all_gather_outputs[0]
        if len(size) != 1 or out.dtype != dtype or out.numel() != int(size[0]):
            return torch.empty(*size, dtype=dtype, device=device)
        self._param.alloc_all_gather_outputs()
        # The same storage under a version counter of its own: the gather's writes must not look, to autograd, like
        # changes of a parameter a backward saved (FSDP2's copy-out keeps the counter for the same reason).
        return out.data


def _gather_in_place(module: nn.Module) -> bool:
    """Has ``module``'s gathers arrive in its parameter (:class:`_IntoParameter`) where that holds: a unit of
    one parameter, sharded on dim 0, on the CPU. Returns whether it did."""
    state = cast(FSDPModule, module)._get_fsdp_state()
    groups = _param_groups(state)
    if len(groups) != 1 or len(groups[0].fsdp_params) != 1 or not hasattr(module, "set_custom_all_gather"):
        return False
    fsdp_param = groups[0].fsdp_params[0]
    if state._device.type != "cpu" or fsdp_param.fsdp_placement.dim != 0:
        return False
    cast(Any, module).set_custom_all_gather(_IntoParameter(fsdp_param))
    return True


def _param_groups(fsdp_state: Any) -> list[Any]:
    """A ``fully_shard`` state's parameter groups: a list in torch 2.13, one group or None in torch 2.11."""
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(fsdp_state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def verify_shard(shard: object, mesh: DeviceMesh) -> Optional[Shard]:
    """The ``Shard`` configuration to use on ``mesh`` (``Shard()`` if the mesh has "dp_shard" and none was given).

    Raises:
        TypeError: ``shard`` is not a ``Shard``.
        ValueError: ``shard`` was given but the mesh has no "dp_shard" dimension to shard over.
    """
    names = mesh.mesh_dim_names or ()
    if shard is None:
        return Shard() if "dp_shard" in names else None
    if not isinstance(shard, Shard):
        raise TypeError(f"shard must be a pipe.distributed.Shard, got {type(shard).__name__}; pass shard=Shard(...)")
    if "dp_shard" not in names:
        raise ValueError(
            f"shard={shard!r} needs a mesh with a 'dp_shard' dimension to shard over, but the mesh has "
            f"{names!r}; build it with make_mesh(pp=..., dp_shard=N), or leave out shard="
        )
    return shard


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: "dp_shard", or ("dp_replicate", "dp_shard") for HSDP."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        if names.index("dp_replicate") > names.index("dp_shard"):
            raise ValueError(
                f"the mesh's dimensions {names!r} put 'dp_shard' before 'dp_replicate'; HSDP needs "
                f"('dp_replicate', 'dp_shard') in that order (make_mesh builds it so)"
            )
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def describe_shard(shard: Optional[Shard]) -> Optional[str]:
    """What every rank must agree on, as comparable text (the policies by name)."""
    if shard is None:
        return None
    blocks = getattr(shard.blocks, "__qualname__", repr(shard.blocks)) if shard.blocks else None
    return (f"Shard(reshard_after_forward={shard.reshard_after_forward}, mp_policy={shard.mp_policy!r}, "
            f"blocks={blocks}, unit={shard.unit!r}, reduce={shard.reduce!r}, "
            f"reshard_after_backward={shard.reshard_after_backward})")
