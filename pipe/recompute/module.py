"""Module-level recompute: mark a layer, and backward recomputes everything inside it.

MindSpore's ``Cell.recompute()`` marks a cell in place: in backward every
operation inside it (and inside its sub-cells) is recomputed, only its output
and its inputs are kept. :func:`recompute` does the same for an ``nn.Module``
on top of :func:`torch.utils.checkpoint.checkpoint` (non-reentrant, random
state replayed, so dropout masks are identical).

A mark is a *policy* stored on the module, and the module's ``forward`` is
routed through :class:`_MarkedForward`; module names, ``state_dict()`` keys and
``isinstance`` are unchanged. The same mechanism carries the selective policy
(:mod:`pipe.recompute.selective`) and the offload policy
(:mod:`pipe.recompute.offload`): one layer carries at most one policy.

A policy applies only where it can save memory. It is skipped (the layer runs
plainly) when grad is disabled, inside the recomputation ``Pipe`` does for a
checkpointed micro-batch (the whole partition is recomputed anyway), and inside
another marked layer's region: the outermost mark wins, so nested marks never
recompute the same operation twice.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch import nn
import torch.utils.checkpoint

from pipe.core.checkpoint import enable_recomputing, is_recomputing
from pipe.core.rng import checkpoint_rng_contexts
from pipe.recompute.stats import scratch_running_stats

__all__: list[str] = []

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_POLICY = "_pipe_recompute_policy"


class _Local(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_local = _Local()


@contextmanager
def _region() -> Iterator[None]:
    """Marks the body as running inside a marked layer (inner marks are ignored there)."""
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1


def in_region() -> bool:
    """Whether the current thread runs inside a layer whose policy is active."""
    return _local.depth > 0


class Policy:
    """What a marked layer does with its activations; subclasses implement :meth:`run`."""

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        """A short description for logs."""
        return type(self).__name__

    def release(self, module: nn.Module) -> None:
        """Called when the policy is taken off ``module`` (replaced or removed)."""

    @staticmethod
    def regioned(forward: Callable[..., Any], module: Optional[nn.Module] = None) -> Callable[..., Any]:
        """``forward`` run inside a region; calls after the first are recomputations.

        A recomputation of ``module`` updates no running statistics: its
        train-mode batch norms run on scratch copies of their buffers
        (:func:`pipe.recompute.stats.scratch_running_stats`), so they are
        updated once per forward, as without the policy.
        """
        calls = 0

        def function(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                with _region():
                    return forward(*args, **kwargs)
            with _region(), enable_recomputing(), scratch_running_stats(module):
                return forward(*args, **kwargs)

        return function


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant), with pipe's random state and clean failures.

    ``preserve_rng_state=True`` is done here, by ``context_fn``
    (:func:`pipe.core.rng.checkpoint_rng_contexts`): torch's own reads and
    writes the generators outside pipe's lock, and two partitions' marked layers
    checkpointing at once could hang the thread runner (:data:`pipe.core.rng._STATE`).
    It covers the CPU generator and the one CUDA device of the tensor arguments;
    arguments on several CUDA devices keep torch's own.

    torch 2.11's non-reentrant checkpoint installs its saved-tensor hooks in a
    generator that a raising forward leaves suspended, so the hooks stay on the
    thread until the generator is collected: later forwards pack into the failed
    checkpoint and their backward replays it (torch 2.13 closes it). The
    generator is found in the traceback and closed here.
    """
    cuda = {a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"}
    if kwargs.get("preserve_rng_state", True) and len(cuda) <= 1:
        device = next(iter(cuda), torch.device("cpu"))
        kwargs["context_fn"] = _with_rng(kwargs.get("context_fn"), device)
        kwargs["preserve_rng_state"] = False
    try:
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
    except BaseException as error:
        frame = error.__traceback__
        while frame is not None:
            code = frame.tb_frame.f_code
            if code.co_name == "checkpoint" and code.co_filename == torch.utils.checkpoint.__file__:
                generator = frame.tb_frame.f_locals.get("gen")
                if generator is not None and hasattr(generator, "close"):
                    generator.close()
            frame = frame.tb_next
        raise


def _with_rng(context_fn: Optional[Callable[[], tuple[Any, Any]]], device: torch.device) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` with the random state saved in its forward context and replayed in its recompute one."""
    def contexts() -> tuple[Any, Any]:
        save, replay = checkpoint_rng_contexts(device)
        if context_fn is None:
            return save, replay
        forward, recompute = context_fn()
        return _Both(save, forward), _Both(replay, recompute)
    return contexts


class _Both:
    """Two contexts entered in order and left in reverse, each time it is entered."""

    def __init__(self, first: Any, second: Any) -> None:
        self._contexts = (first, second)
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for context in self._contexts:
            stack.enter_context(context)
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> Optional[bool]:
        return self._stacks.pop().__exit__(*exc)


class FullRecompute(Policy):
    """Keeps the layer's inputs and output; recomputes everything inside it in backward."""

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        return checkpoint(self.regioned(forward, module), *args, use_reentrant=False, preserve_rng_state=True,
                          **kwargs)

    def describe(self) -> str:
        return "recompute"


class _MarkedForward:
    """A marked module's ``forward``: runs it under the module's policy.

    It refers to its module weakly, so that a marked module is no reference
    cycle (module -> forward -> module) and its memory, GPU memory included,
    is freed when the last reference goes, not at the next garbage
    collection. ``deepcopy`` and ``pickle`` give the copy's forward the
    copied module.
    """

    def __init__(self, module: nn.Module, original: Optional[Callable[..., Any]]) -> None:
        self._module = weakref.ref(module)
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._live()
        forward = self.original if self.original is not None else functools.partial(type(module).forward, module)
        policy: Optional[Policy] = module.__dict__.get(_POLICY)
        if policy is None or not torch.is_grad_enabled() or is_recomputing() or in_region():
            return forward(*args, **kwargs)
        return policy.run(module, forward, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_MarkedForward":
        # Reached while the module itself is deep-copied: its copy is in the memo already.
        return _MarkedForward(copy.deepcopy(self._live(), memo), copy.deepcopy(self.original, memo))

    def _live(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise ReferenceError("the module of this marked forward was deleted; call the module, not its forward")
        return module

    def __reduce__(self) -> tuple[Any, ...]:
        return (_MarkedForward, (self._live(), self.original))


def mark(module: ModuleT, policy: Optional[Policy]) -> ModuleT:
    """Puts ``policy`` on ``module`` (replacing any previous one); ``None`` removes it.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``policy`` not a :class:`Policy`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to mark for recompute, got {type(module).__name__}")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"expected a pipe.recompute Policy, got {type(policy).__name__}")
    current = module.__dict__.get("forward")
    wrapped = isinstance(current, _MarkedForward)
    previous = module.__dict__.get(_POLICY)
    if previous is not None and previous is not policy:
        previous.release(module)
    if policy is None:
        module.__dict__.pop(_POLICY, None)
        if wrapped:
            original = current.original  # type: ignore[union-attr]
            if original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = original
        return module
    module.__dict__[_POLICY] = policy
    if not wrapped:
        module.__dict__["forward"] = _MarkedForward(module, current)
    return module


def unmark(module: ModuleT) -> ModuleT:
    """Removes any recompute/selective/offload policy from ``module``."""
    return mark(module, None)


def policy_of(module: nn.Module) -> Optional[Policy]:
    """The policy on ``module``, or None."""
    return module.__dict__.get(_POLICY)


def recompute(module: ModuleT, enabled: bool = True) -> ModuleT:
    """Marks ``module`` for full recompute (MindSpore ``Cell.recompute()``) and returns it.

    In forward only the module's inputs and output are kept; in backward
    everything inside it is recomputed, with the random state of the first
    forward (dropout masks are identical). Outputs and gradients are those of
    the unmarked module.

    Usage::

        block = pipe.recompute.recompute(model.blocks[3])

    Args:
        module: the layer to mark; it may sit anywhere in a model, also inside
            a ``Pipe`` partition.
        enabled: ``False`` removes the mark.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    return mark(module, FullRecompute() if enabled else None)
