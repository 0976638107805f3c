"""The cut and each rank's order from costs measured on these ranks: one call on every rank.

:func:`pipe.balance.auto_schedule` orders by costs; which costs decides how
good the order is. Layers timed alone on an idle core are cheaper than in a
running pipeline (ranks share the cores and the memory bus), so the order and
its predicted step are off by that much (on the 2-core machine a fifth).
:func:`calibrated_schedule` runs on every rank of the pipeline:

1. rank 0 times the layers and chooses a cut and an order
   (:func:`~pipe.balance.auto_schedule`);
2. every rank runs that order on a copy of the model, ``WARMUP`` steps and
   then ``steps`` steps recorded (:func:`pipe.trace.record`);
3. rank 0 reads each stage's median F, I and W and the runner's time per
   action from the recorded step (:func:`pipe.balance.traced_step`), and
   chooses again by them;

steps 2 and 3 ``rounds`` times, or until the choice stays the same. Every
rank returns rank 0's :class:`~pipe.balance.AutoSchedule` (timings differ
between processes; the table must not)::

    auto = pipe.distributed.calibrated_schedule(model, x, y, chunks=8, loss_fn=F.cross_entropy)
    piped = DistributedPipe(model, chunks=8, schedule=auto.schedule, balance=auto.balance, loss_fn=F.cross_entropy)

The trial steps run on copies: ``model``'s weights and gradients are left as
they were, and each rank holds a second copy of the model until the call
returns. The model must be real, not built on ``meta``: its layers are run.
"""
from __future__ import annotations

import copy
import gc
import logging
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

import pipe.trace
from pipe.balance.auto import AutoSchedule, auto_schedule
from pipe.balance.traced import traced_step
from pipe.core.options import positive_int
from pipe.distributed.distributed_pipe import DistributedPipe
from pipe.distributed.group import decided_on_rank_0

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: Steps each trial runs before it records: the first allocates, the second still runs slow on the CPU.
WARMUP = 2

#: DistributedPipe arguments the calibration chooses or that change the ranks it plans for.
CHOSEN = ("schedule", "balance", "virtual_stages", "chunks", "checkpoint", "mesh", "data_parallel", "shard",
          "parallelize", "tensor_parallel")


def calibrated_schedule(model: nn.Sequential, inputs: Any, target: Any = None, *, chunks: int, loss_fn: Any,
                        checkpoint: str = "except_last", rounds: int = 2, steps: int = 3, timeout: float = 1.0,
                        pipe_options: Optional[dict[str, Any]] = None, **order: Any) -> AutoSchedule:
    """The cut and each rank's order for ``DistributedPipe``, from costs measured on these ranks (see the module
    docstring). Collective: every rank of the world calls it, the world being the pipeline's ranks.

    Args:
        model: the ``nn.Sequential`` to cut, the same on every rank (left untouched: trials run on copies).
        inputs, target: one mini-batch as ``DistributedPipe.step`` takes it, on every rank.
        chunks, loss_fn, checkpoint: as the pipeline will run (``DistributedPipe``'s).
        rounds: times to run the latest choice and choose again by its recorded costs (0: by the layer times
            only).
        steps: steps recorded per round (each stage's costs are medians over their micro-batches).
        timeout: seconds rank 0 times the layers.
        pipe_options: other ``DistributedPipe`` arguments for the trials (``device``, ``loss_reduction``...).
        order: :func:`pipe.balance.auto_schedule`'s options (``placement``, ``in_flight``, ``memory_limit``,
            ``seconds_per_byte``, ``message_seconds``, ``action_seconds``).

    Returns:
        Rank 0's :class:`~pipe.balance.AutoSchedule`, on every rank; ``measured`` is the last recorded step.

    Raises:
        ValueError: a bad argument (on every rank), or no process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("calibrated_schedule runs on the pipeline's ranks: call pipe.distributed.init_from_env() "
                         "first (under torchrun)")
    positive_int("chunks", chunks, "micro-batches per step")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0 (trial runs to calibrate by), got {rounds!r}")
    positive_int("steps", steps, "steps recorded per round")
    options = dict(pipe_options or {})
    clash = sorted(set(options) & set(CHOSEN))
    if clash:
        raise ValueError(f"pipe_options may not give {clash}: the calibration chooses the schedule and the cut "
                         f"for the world's ranks as one pipeline (chunks= and checkpoint= are its own arguments)")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("calibrated_schedule runs the model to time it; build it on a real device, not on "
                         "torch.device('meta')")
    ranks = dist.get_world_size()
    auto: AutoSchedule = decided_on_rank_0(lambda: auto_schedule(
        model, inputs, ranks=ranks, chunks=chunks, checkpoint=checkpoint, timeout=timeout, **order))
    for done in range(rounds):
        trial = DistributedPipe(copy.deepcopy(model), chunks=chunks, checkpoint=checkpoint, schedule=auto.schedule,
                                balance=auto.balance, loss_fn=loss_fn, **options)
        for _ in range(WARMUP):
            trial.step(inputs, target)
            trial.zero_grad(set_to_none=True)
        with pipe.trace.record(None, rank=dist.get_rank()) as recorder:
            for _ in range(steps):
                trial.step(inputs, target)
                trial.zero_grad(set_to_none=True)
        del trial
        gc.collect()  # the trial pipeline's copy of the model sits in reference cycles: free it now
        traces: list[Any] = [None] * ranks
        dist.all_gather_object(traces, recorder.trace())
        before = auto
        auto = decided_on_rank_0(lambda: auto_schedule(
            model, ranks=ranks, chunks=chunks, checkpoint=checkpoint, times=before.times,
            measured=traced_step(traces, balance=before.balance), **order))
        logger.info("calibration %d: %s ran %.4g s per step (simulated from the layer times or the last round: "
                    "%.4g s); by its recorded costs chose %s, balance %s, simulated %.4g s", done + 1,
                    before.schedule.name, auto.measured.wall if auto.measured else float("nan"), before.step,
                    auto.schedule.name, auto.balance, auto.step)
        if auto.balance == before.balance and auto.schedule.programs == before.schedule.programs:
            break
    return auto
