"""A stalled rank ends itself: one watchdog thread per process, for its pipelines.

When a rank stalls (a hang, a long sleep in a hook), its peers give up on it
after the timeout and agree, through the store, on a headline that names it
(``rank 2 stalled: it did not answer within the 4 s timeout ...``,
:mod:`pipe.distributed.failure`). Under torchrun the agent then ends every
rank; started any other way, nothing ended the stalled rank: it ran on until
its own stall ended. NCCL's watchdog aborts a rank whose collective timed out;
gloo has none. This is pipe's.

A daemon thread, started with the first pipeline's failure bookkeeping, reads
every :data:`INTERVAL` seconds the agreed headline of each pipeline's step
(the step in progress, or, between steps, the next one: the others may have
begun it and be waiting for this rank). It ends the process with
``os._exit(STALLED_EXIT)`` when

* the headline blames this rank as stalled (``rank 2 stalled: ...``) and this
  rank has not met the failure itself (a rank whose step is raising, its own
  error or a lost peer, is left to raise); or
* a point-to-point wait of this rank (:func:`waiting`) has run
  :data:`WAIT_SLACK` seconds past its own timeout: the wait should have ended
  by itself.

It never fires in a healthy run: no headline is written unless a step failed,
and long compute, inside a step or between steps, is never judged by itself.
A store it cannot read (its host, rank 0's process or the agent, has ended) it
reads no more.
Before it ends the process it gives the other ranks up to 2 s to report what
they saw and half a second to log it (under torchrun the agent ends them as
soon as this process ends), then logs the reason at ERROR level with the
headline, dumps the stacks of this process's threads (where the stall was) to
standard error, writes torchrun's error file when there is one (the agent's
summary then names this rank and why) and exits.

The thread is stopped at exit, before the process groups are destroyed
(``Watchdog.stop``, registered with ``atexit`` as it starts), and never keeps
the process alive. Not covered: a stall that holds Python's interpreter lock (a C
extension that loops without releasing it): the thread cannot run. A stopped
process (``SIGSTOP``) is ended by its peers instead
(:mod:`pipe.distributed.failure`).
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from contextlib import AbstractContextManager
from typing import Callable, Optional, Protocol

import torch.distributed as dist

__all__: list[str] = []

logger = logging.getLogger(__name__)

STALLED_EXIT = 75
"""The exit status of a process its watchdog ended (``os._exit``): the other ranks blamed it as stalled, or
one of its waits outlived its timeout. The log line before it says which."""

INTERVAL = 0.5
"""Seconds between two looks at the store (one ``check`` per pipeline, on the store's connection)."""

WAIT_SLACK = 5.0
"""Seconds past its own timeout after which a wait is stuck (gloo's waits end at their timeout)."""

_REPORTS = 2.0  # seconds the others get to report what they saw before this process ends
_LOG_PAUSE = 0.5  # and to log their headline once they reported


class Watched(Protocol):
    """What the watchdog asks of a pipeline's failure bookkeeping (:class:`pipe.distributed.failure.Failures`)."""

    rank: int
    reporting: bool  # this rank met the failure itself: it raises it

    def blamed_for_stall(self) -> Optional[str]:
        """The agreed headline if it names this rank as stalled and this rank has not met the failure itself
        (raises if the store cannot be read)."""
        ...

    def await_reports(self, seconds: float) -> None:
        """Returns once every other rank reported on the failed step, or after ``seconds`` (raises if the store
        cannot be read)."""
        ...


class Watchdog:
    """The watchdog of one process (module docstring); tests make their own with another ``end``.

    Args:
        end: ends the process with the given reason; default: log it, dump the stacks and ``os._exit``.
        interval: seconds between two looks.
    """

    def __init__(self, end: Optional[Callable[[str], None]] = None, interval: float = INTERVAL) -> None:
        self.end = end or _end_process
        self.interval = interval
        self.pipelines: "weakref.WeakSet[Watched]" = weakref.WeakSet()
        self.waits: dict[int, tuple[object, float, float]] = {}  # thread -> (what, since, timeout)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def watch(self, pipeline: Watched) -> None:
        """Watches ``pipeline`` (until it is garbage-collected) and starts the thread if it is not running."""
        with self._lock:
            self.pipelines.add(pipeline)
        self.start()

    def start(self) -> None:
        """Starts the thread if it is not running; it is stopped at exit before the process groups are destroyed
        (``atexit`` runs the last registered first, and the group's exit handler is registered at its init)."""
        with self._lock:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="pipe-watchdog", daemon=True)
                self._thread.start()
                atexit.unregister(self.stop)
                atexit.register(self.stop)

    def stop(self) -> None:
        """Stops the thread (it ends within one interval, or one store operation)."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval + 5.0)

    def waiting(self, what: object, timeout: float) -> "_Wait":
        """Marks a wait of at most ``timeout`` seconds on this thread while in the ``with`` block (``what``:
        what is waited for, made a string only if it is reported)."""
        return _Wait(self, what, timeout)

    def reason(self) -> Optional[str]:
        """Why this process should end now, or None (it should not)."""
        with self._lock:
            pipelines = list(self.pipelines)
        for pipeline in pipelines:
            headline = pipeline.blamed_for_stall()
            if headline is not None:
                try:
                    pipeline.await_reports(_REPORTS)
                except Exception:  # the store went away meanwhile: nobody is left to report
                    pass
                time.sleep(_LOG_PAUSE)
                if pipeline.reporting:  # its step raised meanwhile: it reports the failure itself
                    return None
                return (f"rank {pipeline.rank} ended itself (exit status {STALLED_EXIT}): the other ranks gave up "
                        f"on it and agreed that {headline}")
        now = time.monotonic()
        for what, since, timeout in tuple(self.waits.values()):
            if now - since > timeout + WAIT_SLACK:
                rank = dist.get_rank() if dist.is_initialized() else "?"
                return (f"rank {rank} ended itself (exit status {STALLED_EXIT}): its wait ({what}) has run "
                        f"{now - since:.0f} s, past its {timeout:g} s timeout, and did not end by itself")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                reason = self.reason()
            except Exception as error:  # the store is gone with its host (rank 0's process, the agent): nothing
                logger.info("the watchdog stops reading the store: %s", error)  # to read, and every read of a
                with self._lock:  # dead store prints torch's warning with its C++ stack
                    self.pipelines.clear()
                continue
            if reason is not None and not self._stop.is_set():
                self.end(reason)


class _Wait:
    """A wait marked in ``Watchdog.waits`` while its ``with`` block runs (a class: cheaper than a generator)."""

    __slots__ = ("dog", "what", "timeout", "thread")

    def __init__(self, dog: Watchdog, what: object, timeout: float) -> None:
        self.dog, self.what, self.timeout, self.thread = dog, what, timeout, 0

    def __enter__(self) -> None:
        self.thread = threading.get_ident()
        self.dog.waits[self.thread] = (self.what, time.monotonic(), self.timeout)

    def __exit__(self, *exc: object) -> None:
        self.dog.waits.pop(self.thread, None)


def _end_process(reason: str) -> None:
    """Logs ``reason``, dumps the threads' stacks, tells torchrun's agent, and ends the process."""
    logger.error("%s", reason)
    try:
        sys.stderr.write("pipe.distributed.watchdog: the stacks of this process's threads as it ends:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except Exception:  # no usable standard error
        pass
    _tell_torchrun(reason)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    os._exit(STALLED_EXIT)


def _tell_torchrun(reason: str) -> None:
    """Writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``), as its ``@record`` would for an exception: the
    agent's summary then shows ``reason`` and where the main thread was."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    data = {"message": {"message": f"PipelineFailure: {reason}", "extraInfo": {
        "py_callstack": f"{reason}\nThe main thread as the process ended (most recent call last):\n{stack}",
        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        logger.debug("could not write torchrun's error file %s", path, exc_info=True)


_watchdog = Watchdog()


def watch(pipeline: Watched) -> None:
    """Watches ``pipeline``'s failure bookkeeping from this process's watchdog thread (started once)."""
    _watchdog.watch(pipeline)


def waiting(what: object, timeout: float) -> AbstractContextManager[None]:
    """``with waiting(incoming, 60): work.wait(60)``: a wait the watchdog ends the process for if it outruns
    ``timeout`` by :data:`WAIT_SLACK` seconds (``str(what)`` names it then)."""
    return _watchdog.waiting(what, timeout)


def stop() -> None:
    """Stops this process's watchdog thread (at exit, before the process groups are destroyed)."""
    _watchdog.stop()


def _forget_in_child() -> None:
    """A forked child has no watchdog thread and runs none of its parent's pipelines."""
    global _watchdog
    _watchdog = Watchdog()


os.register_at_fork(after_in_child=_forget_in_child)
