"""The caller's thread-local state, carried to where a partition runs and replayed by its recomputation.

PyTorch keeps several switches per thread: grad mode, inference mode,
autocast (enabled and dtype per device type, and its weight-cast cache), and
the default saved-tensor hooks. The plain model runs every layer on the
caller's thread, under the caller's switches. A pipeline runs partitions on
worker threads (:mod:`pipe.threads.worker`), runs their backward there too
(:mod:`pipe.threads.worker_backward`), and replays checkpointed forwards in
backward, on whatever thread autograd uses. :class:`ThreadState` is the one
place that captures those switches and restores them:

- a task captures the caller's state when it is created and its worker
  restores it around the forward (grad mode, inference mode, autocast, hooks);
- a checkpointed cell captures the state of its first forward and its replay
  restores the autocast part under grad mode (as ``torch.utils.checkpoint``
  does), so that the recomputed activations have the first forward's dtypes;
- a backward job captures the state autograd gives the ``Boundary`` node and
  its worker restores it, so that the cell's backward runs as it would on
  autograd's thread.

Carried: grad mode, inference mode, autocast for the CPU and CUDA (enabled,
dtype, and the cache flag), the innermost default saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``, e.g. ``save_on_cpu``).
Not carried: ``__torch_function__`` and ``__torch_dispatch__`` modes (``with
torch.device(...)`` as default device, ``FlopCounterMode``), which hold
per-thread bookkeeping that a second thread must not re-enter; autocast of
other device types. Global settings (deterministic algorithms, anomaly mode,
backend flags, the default dtype) need no carrying.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

__all__: list[str] = []

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


@dataclass(frozen=True)
class ThreadState:
    """A snapshot of the thread-local switches a forward sees (see the module docstring)."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    autocast_cache: bool
    saved_tensors_hooks: Optional[Hooks]

    @staticmethod
    def capture() -> "ThreadState":
        """The current thread's switches."""
        return ThreadState(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=tuple((device_type, torch.is_autocast_enabled(device_type),
                            torch.get_autocast_dtype(device_type)) for device_type in AUTOCAST_DEVICE_TYPES),
            autocast_cache=torch.is_autocast_cache_enabled(),
            saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
        )

    def _autocast(self, stack: ExitStack) -> None:
        for device_type, enabled, dtype in self.autocast:
            # Entered also to switch off an autocast the current thread has and the captured one had not.
            if enabled or torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))

    @contextmanager
    def restore(self) -> Iterator[None]:
        """Runs the body under the captured switches, on any thread."""
        with ExitStack() as stack:
            if self.inference_mode != torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            self._autocast(stack)
            if self.saved_tensors_hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks))
            yield

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Runs the body as the recomputation of a forward captured here: grad on, the forward's autocast."""
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            self._autocast(stack)
            yield


@contextmanager
def without_autocast() -> Iterator[None]:
    """Runs the body with autocast off (a backward pass, as the plain model's outside ``torch.autocast``)."""
    with ExitStack() as stack:
        for device_type in AUTOCAST_DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
