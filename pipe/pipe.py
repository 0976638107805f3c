"""The ``Pipe`` front end: validate, partition, split into micro-batches, run, gather.

``Pipe(model, chunks=8, checkpoint="except_last")`` is a drop-in for the
``nn.Sequential`` it wraps: same outputs, same gradients, same state-dict keys,
with the layers spread over partitions that work on micro-batches concurrently.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from pipe.compile import CompileOption, compile_stages
from pipe.spec import PipelineSpec
from pipe.core.options import checkpoint_stop, verify_one_value_layers
from pipe.core.microbatch import gather, pack_inputs, scatter, verify_device, verify_gatherable
from pipe.core.partition import Device, split_module
from pipe.core.sequential import PipeSequential, sequential_like
from pipe.batchnorm import convert_deferred_batch_norm, deferred_batch_norms
from pipe.graph_split import keep_original_names
from pipe.threads.pipeline import Pipeline
from pipe.recompute.attach import attach_to_pipeline
from pipe.recompute.config import ConfigSource
from pipe.recompute.strategy import RecomputeStrategy
from pipe.skip.layout import inspect_skip_layout
from pipe.skip.skippable import verify_skippables
from pipe.threads.call import CallLock
from pipe.threads.worker import Workers, partition_threads

__all__: list[str] = []

logger = logging.getLogger(__name__)

_MOVING_DENIED = (
    "a Pipe cannot be moved: it places its partitions on pipe.devices itself; "
    "move the layers before wrapping them, or pass balance= and devices= to Pipe "
    "(changing the dtype, e.g. pipe.to(torch.float64), is allowed)"
)


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe pipeline parallelism.

    Usage::

        model = nn.Sequential(a, b, c, d)
        model = Pipe(model, chunks=8, balance=[2, 2], devices=["cuda:0", "cuda:1"])
        output = model(input)          # input on model.devices[0]
        output.sum().backward()        # output on model.devices[-1]

    Args:
        module: the model, an ``nn.Sequential`` whose layers each take the
            previous layer's output, or a :class:`pipe.PipeSequential`, whose
            layers take a tuple returned by the previous one as arguments
            (torch's ``Pipe`` convention; kept across partition boundaries).
        chunks: number of micro-batches each mini-batch is split into (dim 0).
        checkpoint: which micro-batches drop their activations in forward and
            recompute them in backward: ``"always"``, ``"except_last"`` (all but
            the last, whose backward starts right away) or ``"never"``.
        balance: layers per partition. Without it, partitions follow where the
            layers already are (consecutive layers on one device form one
            partition).
        devices: one device per partition (with ``balance``). Default: the
            visible CUDA devices, or the CPU for every partition.
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch instead of once per micro-batch.
        cpu_threads: intra-op threads of each CPU partition's worker. Default:
            PyTorch's thread count divided among the CPU partitions, so that
            partitions use the cores side by side instead of competing.
        recompute: a recompute/swap config (a YAML path or a dict, see
            docs/recompute.md): full, selective and offload policies per
            layer, stage = partition; best with ``checkpoint="never"``.
            The normalised strategy is ``pipe.recompute_strategy``.
        compile: compile each layer of each partition with ``torch.compile``:
            ``True`` (inductor, dynamic shapes) or a dict of its keywords
            (``backend``, ``mode``, ``options``, ``fullgraph``, ``dynamic``) and
            ``exclude`` (layer names left eager); see :mod:`pipe.compile`.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or an argument has
            the wrong type.
        ValueError: bad ``chunks``, ``checkpoint`` or ``balance``, a layer
            listed twice, or a buffer shared by partitions on different
            devices (shared parameters are tied, see :mod:`pipe.core.tying`).
        IndexError: fewer devices than partitions.
    """

    def __init__(
        self,
        module: nn.Sequential,
        chunks: int = 1,
        checkpoint: str = "except_last",
        *,
        balance: Optional[Sequence[int]] = None,
        devices: Optional[Sequence[Device]] = None,
        deferred_batch_norm: bool = False,
        cpu_threads: Optional[int] = None,
        recompute: Optional[ConfigSource] = None,
        compile: CompileOption = False,
    ) -> None:
        super().__init__()
        self.plan: Optional[Any] = None  # the pipe.plan.Plan it runs, when pipe.plan.planned_pipe built it
        spec = self.spec = PipelineSpec.checked(chunks, checkpoint, balance=balance,
                                                deferred_batch_norm=deferred_batch_norm, recompute=recompute,
                                                compile=compile, cpu_threads=cpu_threads)
        self.chunks, self.checkpoint, self.deferred_batch_norm = spec.chunks, spec.checkpoint, spec.deferred_batch_norm
        if deferred_batch_norm and isinstance(module, nn.Sequential):
            module = convert_deferred_batch_norm(module)

        if isinstance(module, nn.Sequential) and not isinstance(module, PipeSequential):  # one value per layer
            verify_one_value_layers(module.named_children())
        partitions, balance, devices = split_module(module, None if spec.balance is None else list(spec.balance),
                                                    devices)
        verify_skippables(module)
        self._deferred_batch_norms = deferred_batch_norms(module, self.chunks)
        self.skip_layout = inspect_skip_layout(partitions)
        # The layers are this module's children under their original names, so
        # state_dict() keys are those of the wrapped nn.Sequential.
        for name, layer in module._modules.items():
            self.add_module(name, layer)
        keep_original_names(self)  # stages of pipe.split: the original model's keys
        self.partitions: list[nn.Sequential] = partitions
        self.balance: list[int] = balance
        self.devices: list[torch.device] = devices
        self.compiled_layers = compile_stages(partitions, spec.compile)

        cpu_partitions = sum(1 for d in devices if d.type == "cpu")
        cpu_threads = partition_threads(spec.cpu_threads, cpu_partitions)
        cores = os.cpu_count() or 1
        if cpu_partitions > 1 and cpu_threads is not None and cpu_threads * cpu_partitions > cores:
            fix = (f"cpu_threads={max(1, cores // cpu_partitions)}" if cpu_threads > 1
                   else f"at most {cores} CPU partitions")
            warnings.warn(
                f"{cpu_partitions} CPU partitions x cpu_threads={cpu_threads} need "
                f"{cpu_partitions * cpu_threads} threads but this machine has {cores} cores, so partitions "
                f"compete for them; this runs, but faster with {fix}",
                stacklevel=2,
            )
        self.cpu_threads = cpu_threads
        self._workers = Workers(self.devices, cpu_threads)
        self._pipeline = Pipeline(self.partitions, self.devices, self._workers, self.skip_layout)
        # Calls from several threads run one at a time (pipe.threads.call; docs/reliability.md).
        self._call_lock = CallLock()
        self.recompute_strategy: Optional[RecomputeStrategy] = None
        if spec.recompute is not None:
            self.recompute_strategy = attach_to_pipeline(self.partitions, spec.recompute, self.checkpoint,
                                                         self._pipeline)
        logger.info("Pipe: balance=%s devices=%s chunks=%d checkpoint=%s cpu_threads=%s",
                    balance, [str(d) for d in devices], self.chunks, self.checkpoint, cpu_threads)

    # -- nn.Sequential-like access to the layers ---------------------------------------

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter([layer for layer in self._modules.values() if layer is not None])

    def __getitem__(self, index: Union[int, slice]) -> Any:
        layers = [(name, layer) for name, layer in self._modules.items() if layer is not None]
        if isinstance(index, slice):
            return sequential_like(self.partitions[0], layers[index])
        return layers[index][1]

    # -- placement belongs to Pipe ------------------------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        # Decided from the arguments alone, before PyTorch parses a device: to(0) on a
        # machine without CUDA must give this error, not "Cannot access accelerator".
        moving = kwargs.get("device") is not None or "tensor" in kwargs or (
            bool(args) and isinstance(args[0], (torch.device, int, str, torch.Tensor)))
        if moving:
            raise TypeError(_MOVING_DENIED)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipe":
        raise TypeError(_MOVING_DENIED)

    def cpu(self) -> "Pipe":
        raise TypeError(_MOVING_DENIED)

    def close(self) -> None:
        """Ends the worker threads now (they also end when the Pipe is collected).

        A forward running meanwhile in another thread fails at once with
        ``pipe.threads.call.PipeClosedError``; a later call starts new threads.
        """
        self._workers.close()

    @property
    def worker_backward(self) -> bool:
        """Whether CPU partitions back-propagate side by side on their workers (pipe.threads.worker_backward).

        On by default when every partition is on the CPU (and there are no
        skip connections). Set it to False for autograd's own backward on the
        caller's thread, e.g. for ``create_graph=True`` (with ``checkpoint="never"``).
        """
        return self._pipeline.worker_backward

    @worker_backward.setter
    def worker_backward(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"worker_backward must be True or False, got {enabled!r}")
        if enabled and not (len(self.devices) > 1 and all(d.type == "cpu" for d in self.devices)
                            and self.skip_layout is None):
            raise ValueError("worker_backward=True needs several partitions, all on the CPU, and no skip "
                             f"connections; this Pipe has devices {[str(d) for d in self.devices]}")
        self._pipeline.worker_backward = enabled

    # -- forward ------------------------------------------------------------------------

    def forward(self, *inputs: Any) -> Any:
        """Runs the pipeline.

        Calls from several threads are serialised: one runs at a time.

        Args:
            inputs: what the first layer takes. With several, the first layer
                of an ``nn.Sequential`` receives them as one tuple, the first
                layer of a :class:`pipe.PipeSequential` as its arguments.
                Tensors are split on dim 0 into micro-batches; other values,
                and tensors wrapped in :class:`pipe.NoChunk`, reach every
                micro-batch unchanged.

        Returns:
            The last layer's output, micro-batches concatenated on dim 0, on
            ``devices[-1]``.

        Raises:
            ValueError: with several micro-batches, the last layer's output
                mixes samples (a 0-dim tensor, or dim 0 not following the batch).
        """
        with self._call_lock:
            return self._forward(*inputs)

    def _forward(self, *inputs: Any) -> Any:
        if not inputs:
            raise TypeError("Pipe.forward() needs at least one input")
        value = pack_inputs(inputs)
        if not self.partitions:
            return value  # no layers: the input, as an empty nn.Sequential returns it
        self._verify_input_device(value)
        batches = scatter(value, self.chunks)
        stop = checkpoint_stop(self.checkpoint, len(batches))
        if not (self.training and torch.is_grad_enabled()):
            stop = 0
        self._pipeline.training = self.training
        for bn in self._deferred_batch_norms:
            bn.discard()  # what a failed step left behind
        sizes = [batch.tensors[0].size(0) for batch in batches]
        self._pipeline.run(batches, stop)
        last = self.partitions[-1]
        verify_gatherable(sizes, batches, f"the last layer {list(last._modules)[-1]!r} "
                                          f"(partition {len(self.partitions) - 1})")
        for bn in self._deferred_batch_norms:
            bn.commit()  # running statistics once per mini-batch
        return gather(batches)

    def _verify_input_device(self, value: Any) -> None:
        verify_device(value, self.devices[0], "input",
                      f"the first partition is on {self.devices[0]}; move it with input.to(pipe.devices[0])")

