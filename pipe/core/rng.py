"""Random number state: capture it for recomputation and keep partitions' draws apart.

Recomputation must draw the same random numbers as the first forward (the
same dropout mask), so the state of the generators a partition uses is saved
before a checkpointed forward and replayed around its recomputation.

PyTorch has one CPU generator per process and one generator per CUDA device,
shared by every thread. When two partitions on one device run concurrently and
both draw random numbers, their draws interleave, and a replay from the saved
state would not reproduce either of them. :class:`RandomnessGuard` prevents
that without giving up concurrency where it is safe: the first time a partition
runs in a mode (training or not) it runs under the generator's lock and is
watched; partitions that drew random numbers keep taking the lock, those that
did not run freely from then on. Under the lock, each cell draws from its own
stream, seeded from one draw of the global generator per forward, so that
which partition takes the lock first changes nothing.

The locks are scoped by :class:`GeneratorLocks`: top-level calls share the
process's locks; a call made inside a cell that holds one (a ``Pipe`` used as a
layer of another ``Pipe``) gets fresh locks for the generators its caller
holds, so its cells do not wait for their own caller. A process forked from
one whose threads held locks starts with free ones.
"""
from __future__ import annotations

import contextlib
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

__all__: list[str] = []

RNGState = tuple[Tensor, Optional[Tensor]]


def _generator_key(device: torch.device) -> str:
    return str(device) if device.type == "cuda" else "cpu"


class GeneratorLocks:
    """One lock per random generator (the CPU's, each CUDA device's), for the cells of a call.

    Args:
        parent: where the locks not made here come from (None: the process's own).
        fresh: generators that get a lock of their own here.
    """

    def __init__(self, parent: Optional["GeneratorLocks"] = None, fresh: frozenset[str] = frozenset()) -> None:
        self._parent = parent
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {key: threading.Lock() for key in fresh}

    def lock(self, device: torch.device) -> threading.Lock:
        """The lock of ``device``'s generator."""
        key = _generator_key(device)
        with self._guard:
            lock = self._locks.get(key)
            if lock is not None or self._parent is None:
                if lock is None:
                    lock = self._locks[key] = threading.Lock()
                return lock
        return self._parent.lock(device)

    @staticmethod
    def for_call() -> "GeneratorLocks":
        """The locks for a new call made on this thread.

        At top level, the process's. Inside a cell that holds locks (a nested
        pipeline), a child with fresh locks for those generators: the caller
        keeps every other cell away from them while its inner cells run.
        """
        held: list[tuple[GeneratorLocks, str]] = getattr(_held, "stack", [])
        if not held:
            return _process_locks()
        return GeneratorLocks(held[-1][0], frozenset(key for _, key in held))


class _Held(threading.local):
    """The locks this thread holds, innermost last."""

    def __init__(self) -> None:
        self.stack: list[tuple[GeneratorLocks, str]] = []


_held = _Held()
_root = GeneratorLocks()
_root_pid = os.getpid()


def _process_locks() -> GeneratorLocks:
    global _root, _root_pid, _held
    if _root_pid != os.getpid():
        # Forked: threads that held locks in the parent do not exist here.
        _root, _root_pid, _held = GeneratorLocks(), os.getpid(), _Held()
    return _root


#: Every read, write and seeding of a generator's state that pipe makes holds this lock. PyTorch's
#: ``get_rng_state`` keeps the generator's mutex while it makes the returned tensor's Python object,
#: which can run the garbage collector, whose finalizers can hand the interpreter lock to another
#: thread; a second thread reading, writing or seeding that generator then waits for the mutex
#: *holding* the interpreter lock, and neither thread moves again (partitions checkpointing at once
#: hung the thread runner this way, beyond the reach of any timeout in the process). A thread waiting
#: on this lock lets the interpreter lock go.
_STATE = threading.Lock()


def _reset_state_lock() -> None:
    global _STATE
    _STATE = threading.Lock()  # a forked child: the thread that held it is not there


os.register_at_fork(after_in_child=_reset_state_lock)


def save_rng_state(device: torch.device) -> RNGState:
    """The CPU generator's state and, for a CUDA device, that device's."""
    with _STATE:
        cpu = torch.get_rng_state()
        gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, gpu


def _set_rng_state(device: torch.device, state: RNGState) -> None:
    cpu, gpu = state
    with _STATE:
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)


@contextmanager
def _forked(device: torch.device) -> Iterator[None]:
    """``torch.random.fork_rng`` for the CPU generator and ``device``'s, its reads and writes under the lock."""
    saved = save_rng_state(device)
    try:
        yield
    finally:
        _set_rng_state(device, saved)


@contextmanager
def restore_rng_state(device: torch.device, state: RNGState) -> Iterator[None]:
    """Runs the body from ``state`` and puts the generators back afterwards."""
    with _forked(device):
        _set_rng_state(device, state)
        yield


class _Replay:
    """The recomputation's context: runs from the state saved when the forward began, then puts the
    generators back (entered again for each recomputation, as a second backward may need)."""

    def __init__(self, device: torch.device, saved: list[RNGState]) -> None:
        self._device, self._saved = device, saved
        self._outer: list[RNGState] = []  # the state each entry found, put back on its exit

    def __enter__(self) -> None:
        if not self._saved:
            raise RuntimeError("a checkpoint recomputed a forward whose random state was never saved")
        self._outer.append(save_rng_state(self._device))
        _set_rng_state(self._device, self._saved[-1])

    def __exit__(self, *exc: object) -> None:
        _set_rng_state(self._device, self._outer.pop())


@contextmanager
def _saving(device: torch.device, saved: list[RNGState]) -> Iterator[None]:
    saved.append(save_rng_state(device))
    yield


def checkpoint_rng_contexts(device: torch.device) -> tuple[contextlib.AbstractContextManager[Any],
                                                             contextlib.AbstractContextManager[Any]]:
    """``torch.utils.checkpoint``'s ``preserve_rng_state=True``, as a ``context_fn`` pair, under the lock.

    The first context saves the CPU generator's state and ``device``'s when the
    forward begins; the second runs each recomputation from it and puts the
    generators back. torch's own ``preserve_rng_state`` reads and writes the
    generators without :data:`_STATE`, so partitions checkpointing at once could
    hang (see :data:`_STATE`); :func:`pipe.recompute.module.checkpoint` uses these.
    """
    saved: list[RNGState] = []
    return _saving(device, saved), _Replay(device, saved)


class RandomnessGuard:
    """Gives a partition's forward its own random stream, and the generator to itself while it draws.

    One guard per partition. Use ``with guard.forward(training, seed):`` around
    every forward of the partition that runs concurrently with other
    partitions. While a partition that draws random numbers runs, it holds its
    device's generator lock and the generator is seeded with ``seed`` (the
    caller derives one per cell from the global generator), then put back: the
    numbers a cell draws depend on the seed, not on which thread got there
    first, so seeded runs are reproducible.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # training flag -> whether the partition draws random numbers
        self._draws: dict[bool, bool] = {}

    def draws(self, training: bool) -> Optional[bool]:
        """Whether the partition was seen drawing random numbers (None: not run yet)."""
        return self._draws.get(training)

    @contextmanager
    def forward(self, training: bool, seed: Optional[int] = None,
                locks: Optional[GeneratorLocks] = None) -> Iterator[None]:
        """Runs the body of one forward of the partition.

        Args:
            training: the mode, which decides whether the partition draws (dropout).
            seed: the cell's seed; None draws from the global generator as it
                stands (when no other cell can run concurrently).
            locks: the locks of the call the cell belongs to
                (:meth:`GeneratorLocks.for_call`, taken on the caller's thread);
                default: the process's.
        """
        known = self._draws.get(training)
        if known is False:
            yield
            return
        scope = locks if locks is not None else _process_locks()
        with scope.lock(self.device), _holding(scope, self.device), \
                (_forked(self.device) if seed is not None else contextlib.nullcontext()):
            if seed is not None:
                with _STATE:
                    torch.default_generator.manual_seed(seed)
                    if self.device.type == "cuda":
                        torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
            if known is None:
                before = save_rng_state(self.device)
                yield
                after = save_rng_state(self.device)
                self._draws[training] = not _same(before, after)
            else:
                yield


@contextmanager
def _holding(scope: GeneratorLocks, device: torch.device) -> Iterator[None]:
    """Records that this thread holds ``scope``'s lock of ``device``'s generator."""
    _held.stack.append((scope, _generator_key(device)))
    try:
        yield
    finally:
        _held.stack.pop()


def cell_seed(base: int, microbatch: int, partition: int) -> int:
    """A cell's seed, derived from one draw of the global generator per forward."""
    return (base * 1_000_003 + microbatch * 7_919 + partition) % (2**63 - 1)


def draw_base_seed() -> int:
    """One draw from the global CPU generator: what makes a forward's random streams follow torch.manual_seed."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _same(a: RNGState, b: RNGState) -> bool:
    if not torch.equal(a[0], b[0]):
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    return torch.equal(a[1], b[1])
