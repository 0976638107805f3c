"""Failures across ranks: every rank's headline names the root cause, agreed through the store.

When a layer raises on one rank, its peers are blocked in receives that will
never complete. No torch call interrupts a blocked gloo or NCCL wait from the
outside, but the wait ends when the failed process exits or shuts its
connections down (they close) or when the process group's timeout expires. A rank may also die
without raising (killed, ``os._exit``) or stop (``SIGSTOP``, a hang). Each rank
that fails leaves evidence in the job's key-value store (the
``torch.distributed`` store, hosted by torchrun's agent), under a namespace of
the pipeline and the step::

    raised/<rank>    "rank 1 failed in F3@1: ValueError: ..."     a rank's own error
    lost/<rank>      "<peer> closed|timeout <where>"               a rank lost contact with a peer
    process/<rank>   "<host> <pid> <start time>"                   who each rank is (at construction)
    root             the agreed headline (the first written wins)

and works out the root cause from it: a rank's own error if one was raised
(the first published), else the rank at the end of the chain of lost
contacts — a rank that lost contact with rank P, while P itself published
nothing, blames P: P died (its connections closed) or stalled (it did not
answer within the timeout). A rank that lost contact only because its peer
waited for a third rank follows the peer's record to that rank. Before a
chain ends in a stall, a silent rank whose process on this machine has ended
is blamed instead (died): the rank at the end of the chain may be waiting on
it, its own timeout not yet out. The headline
is written once with ``compare_set`` so that every rank raises the same one:
``PipelineFailure: rank 2 stopped in F2@2 because rank 1 died ...``.

A stalled peer on this machine whose process is stopped (state ``T``:
``SIGSTOP``, a job-control stop) cannot end by itself and does not react to
torchrun's ``SIGTERM``; it is ended with ``SIGKILL`` once the timeout has
passed, so the job ends after about the timeout instead of the timeout plus
torchrun's 30 s grace period. Under torchrun (``TORCHELASTIC_ERROR_FILE`` set)
a rank that fails because of another rank's failure waits
:data:`AGENT_GRACE` seconds before raising, so that the agent records the
root-cause rank's exit first and its summary points at that rank.

The stalled rank itself ends once the others agreed that it stalled: its
process's watchdog (:mod:`pipe.distributed.watchdog`) reads the headline and
ends the process, whoever started the ranks.

Once a rank has its verdict (its own error published, or the agreed
headline), it shuts down the connections of the failed groups
(:mod:`pipe.distributed.connections`): the partners still blocked on it in a
receive or a collective are released at once ("Connection closed by peer"),
read the headline and raise it, and no wait is left running to hold a
process at exit. A collective's lost connection names its peer's address,
which leads to the peer's rank. A save runs under the same bookkeeping
(:func:`naming_failures`): a rank that dies in ``state.save`` or ``hf.save`` is
named as in a step (``rank 0 stopped in state.save because rank 2 died``).
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch.distributed as dist

from pipe.distributed import connections, watchdog
from pipe.distributed.mesh import spoil_reused
from pipe.distributed.transport import PeerError

__all__: list[str] = []

logger = logging.getLogger(__name__)

AGENT_GRACE = 1.0
"""Seconds a rank failing because of another rank waits under torchrun (its agent polls every 0.1 s)."""

_SETTLE = 2.0  # seconds a rank that timed out waits for the peer it blames to say whom it waits for
_POLL = 0.05
_instances = itertools.count()  # pipelines are built in the same order on every rank: same numbers


class PipelineFailure(RuntimeError):
    """This rank stopped because another rank of the pipeline failed (the message names it and how)."""


def _store() -> Optional[dist.Store]:
    return connections.job_store()


def _process_identity() -> str:
    """``host pid start-time``: enough to find this process again, and not another with its pid."""
    return f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _state(pid: int) -> str:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` a zombie...), ``?`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _stopped(pid: int) -> bool:
    return _state(pid) == "T"


def _gone(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` has ended (a zombie has: it waits to be reaped)."""
    if start == "?":
        return False
    return _start_time(pid) != start or _state(pid) in ("Z", "X")


class Failures:
    """The failure evidence and verdicts of one pipeline (one per ``Runtime``), step by step, or of one save.

    Args:
        rank: this rank's global rank.
        world: the number of ranks.
        timeout: the process group's timeout in seconds (named in verdicts about stalls).
        kind: whose groups a failure shuts down (:func:`pipe.distributed.connections.abort`): ``"pipeline"``
            (a step's), or ``"checkpoints"`` (a save's, :func:`naming_failures`).
    """

    def __init__(self, rank: int, world: int, timeout: float, kind: str = "pipeline") -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.kind = kind
        self.instance = next(_instances)
        self.step = 0
        self.broken: Optional[str] = None  # the headline of the failure that broke the pipeline
        self.running = False  # a step is in progress (between begin_step and end_step)
        self.reporting = False  # this rank met a failure: it raises it itself (failure_from)
        self._stopped_peer: Optional[int] = None  # pid of a stopped peer on this machine to end
        self._set(f"pipe/{self.instance}/process/{rank}", _process_identity())
        watchdog.watch(self)

    def begin_step(self) -> None:
        """Starts a new namespace for the evidence of the next step (called by every rank alike).

        Raises:
            PipelineFailure: an earlier step failed; the pipeline cannot run another.
        """
        if self.broken is not None:
            raise PipelineFailure(
                f"this DistributedPipe is broken: step {self.step} failed ({self.broken}). Its ranks are out of "
                "step and messages of the failed step may still be in flight, so it runs no further step. "
                "To go on, build a new DistributedPipe on every rank (its messages have tags of their own; give it "
                "a new mesh from make_mesh if it had one: the failed step's groups were shut down) and load the "
                "last checkpoint into it (pipe.distributed.state.load), or restart the job"
            )
        self.step += 1
        self.running = True

    def end_step(self) -> None:
        """The step ended (completed or raised): until the next, the watchdog looks at the next step's headline."""
        self.running = False

    def require_same(self, name: str, value: bool) -> None:
        """Raises if another rank passed the other ``value`` of ``name`` in this step (call inside the step).

        Each rank counts its value in the store, then reads the other value's
        count: of two ranks that disagree, the later one sees the earlier one's
        count and raises, which names it on every rank as any raise in a step
        does, at once, where the ranks would otherwise wait on each other for
        the whole timeout. Two small store requests per step.

        Raises:
            ValueError: ranks disagree on ``name``.
        """
        store = _store()
        if store is None:
            return
        try:
            store.add(self._key(f"{name}/{value}"), 1)
            others = int(store.add(self._key(f"{name}/{not value}"), 0))
        except Exception:  # the store may be gone with its host: the step's own waits find that
            logger.debug("could not compare %s with the other ranks", name, exc_info=True)
            return
        if others:
            raise ValueError(
                f"step({name}={value}) on rank {self.rank}, but {others} other rank(s) passed {name}={not value} "
                f"in the same step: every rank must pass the same value (an optimizer step's passes are the same "
                f"on every rank; the ranks would wait on each other until the timeout)")

    # -- the watchdog's questions ---------------------------------------------------------------

    def _watched_key(self, name: str) -> str:
        """The key of ``name`` in the step in progress, or between steps in the next (the others may be in it)."""
        return f"pipe/{self.instance}/{self.step if self.running else self.step + 1}/{name}"

    def blamed_for_stall(self) -> Optional[str]:
        """The agreed headline if it blames this rank as stalled while this rank has not met the failure itself.

        Raises:
            RuntimeError: the store cannot be read (its host has ended): the watchdog stops reading it.
        """
        store = _store()
        if self.reporting or self.broken is not None or store is None:
            return None
        key = self._watched_key("root")
        if not store.check([key]):
            return None
        headline = store.get(key).decode()
        return None if self.reporting or not headline.startswith(f"rank {self.rank} stalled") else headline

    def await_reports(self, seconds: float) -> None:
        """Returns once every other rank published its evidence on the failed step, or after ``seconds``.

        Raises:
            RuntimeError: the store cannot be read.
        """
        store, deadline = _store(), time.monotonic() + seconds
        while store is not None and time.monotonic() < deadline:
            if int(store.add(self._watched_key("reported"), 0)) >= self.world - 1:
                return
            time.sleep(_POLL)

    # -- the store ------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"pipe/{self.instance}/{self.step}/{name}"

    @staticmethod
    def _set(key: str, value: str) -> None:
        store = _store()
        if store is None:
            return
        try:
            store.set(key, value)
        except Exception:  # the store may be gone with the rank that hosted it; local evidence remains
            logger.debug("could not write %s to the store", key, exc_info=True)

    @staticmethod
    def _get(key: str) -> Optional[str]:
        store = _store()
        if store is None:
            return None
        try:
            return store.get(key).decode() if store.check([key]) else None
        except Exception:
            return None

    def _agree(self, verdict: str) -> str:
        """The headline every rank uses: the first verdict written for this step, else ``verdict``."""
        store = _store()
        if store is None:
            return verdict
        try:
            agreed = store.compare_set(self._key("root"), "", verdict)
            return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        except Exception:
            return verdict

    # -- verdicts -------------------------------------------------------------------------------

    def failure_from(self, where: str, error: BaseException) -> BaseException:
        """The exception this rank raises for ``error`` met in ``where``.

        If ``error`` is this rank's own (a layer, the loss, bad inputs), it is
        published and returned with a note naming the rank and the action.
        If it is a lost peer (a closed connection, a timeout), the root cause
        is worked out from the store and a :class:`PipelineFailure` naming it
        is returned; the first verdict of the step is every rank's headline.
        """
        self.reporting = True  # the watchdog leaves this rank to raise, whatever the headline
        result = self._verdict(where, error)
        self.broken = str(result).splitlines()[0] if str(result) else type(result).__name__
        # The verdict is published: the partners still blocked on this rank (a posted receive, a collective)
        # are released now, read it and raise it too, and no wait is left to hold this process at exit.
        connections.abort(self.kind)
        if self.kind == "pipeline":
            spoil_reused()  # the next pipeline of this job starts on new groups
        if isinstance(result, PipelineFailure) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            time.sleep(AGENT_GRACE)  # let the agent see the root-cause rank's exit first
        return result

    def _verdict(self, where: str, error: BaseException) -> BaseException:
        peer = _peer_of(error)
        if peer is None:
            return self._raised(where, error)
        peer_rank, timed_out = peer
        first_line = str(error).splitlines()[0] if str(error) else ""
        self._publish("lost", f"{'?' if peer_rank is None else peer_rank} {'timeout' if timed_out else 'closed'} {where}")
        cause = self._root_cause(peer_rank, timed_out, where)
        if cause is not None:
            headline = self._agree(cause)
        else:  # never agreed: a verdict without a rank must not become the headline of ranks that know one
            agreed = self._get(self._key("root"))
            if agreed is not None:
                headline = agreed
            elif peer_rank is not None and not self._gave_up(peer_rank):  # no store to agree through: what
                headline = self._describe(peer_rank, timed_out, f"rank {self.rank} in {where}")  # this rank saw
            else:
                silent = self._silent()
                suspects = f"; ranks that reported nothing: {', '.join(map(str, silent))}" if silent else ""
                headline = (f"a collective operation failed and no rank reported why ({type(error).__name__}: "
                            f"{first_line}){suspects}")
        if self._stopped_peer is not None and "was ended with SIGKILL" in headline:
            try:
                os.kill(self._stopped_peer, signal.SIGKILL)  # torchrun's SIGTERM cannot end a stopped process
            except OSError:
                pass
            self._stopped_peer = None
        if headline.startswith(f"rank {self.rank} "):  # the others gave up on this rank (it stalled)
            text = f"rank {self.rank} stopped in {where}: the pipeline failed because {headline}"
        else:
            text = f"rank {self.rank} stopped in {where} because {headline}"
        failure = PipelineFailure(f"{text} (here: {type(error).__name__}: {first_line})")
        failure.__cause__ = error
        logger.error("%s", failure)
        return failure

    def _raised(self, where: str, error: BaseException) -> BaseException:
        """This rank's own error: published (a root-cause candidate) and returned with a note."""
        message = f"rank {self.rank} failed in {where}: {type(error).__name__}: {error}"
        self._publish("raised", message)
        self._agree(message)
        logger.error("%s", message)
        if hasattr(error, "add_note"):
            error.add_note(f"pipe.distributed: rank {self.rank} failed in {where}")
        return error

    def _raised_by_others(self) -> list[str]:
        found = (self._get(self._key(f"raised/{rank}")) for rank in range(self.world) if rank != self.rank)
        return [message for message in found if message is not None]

    def _publish(self, kind: str, message: str) -> None:
        """Writes this rank's evidence (``raised`` or ``lost``) and counts it among the step's reports."""
        self._set(self._key(f"{kind}/{self.rank}"), message)
        store = _store()
        if store is not None:
            try:
                store.add(self._key("reported"), 1)
            except Exception:
                logger.debug("could not count this rank's report", exc_info=True)

    def _gave_up(self, peer: int) -> bool:
        """Whether ``peer`` published that it lost a collective's peer, not knowing which: it is a survivor whose
        wait ended (it closed its connections as it raised), not the failed rank, which the others' reports find."""
        record = self._get(self._key(f"lost/{peer}"))
        return record is not None and record.startswith("? ")

    def _reported(self) -> int:
        store = _store()
        try:
            return int(store.add(self._key("reported"), 0)) if store is not None else 0
        except Exception:
            return 0

    def _silent(self) -> list[int]:
        """The other ranks that published nothing this step (neither an error nor a lost peer)."""
        return [rank for rank in range(self.world) if rank != self.rank
                and self._get(self._key(f"raised/{rank}")) is None and self._get(self._key(f"lost/{rank}")) is None]

    def _root_cause(self, peer: Optional[int], timed_out: bool, where: str) -> Optional[str]:
        """The root cause as a phrase (``"rank 1 died ..."``), or None without evidence to go on.

        A lost peer that is not known (a collective of FSDP, HSDP or tensor
        parallelism failed: gloo names an address, not a rank) is the one rank
        that published nothing once every other rank has: the survivors all
        end their waits within about the timeout, the failed rank never writes.
        """
        if _store() is None:
            return None
        settle = min(_SETTLE, self.timeout) if timed_out else 0.0
        if peer is None or self._gave_up(peer):  # the others' waits end within the timeout: then only the
            settle = self.timeout + _SETTLE       # failed rank is silent
        deadline = time.monotonic() + settle
        while True:
            raised = self._raised_by_others()
            if raised:
                return raised[0]
            agreed = self._get(self._key("root"))
            if agreed is not None:
                return agreed
            blamed = self._follow(peer if peer is not None else self._only_silent())
            if blamed is not None and (time.monotonic() >= deadline or not timed_out or peer is None):
                if blamed[1]:  # a stall, unless a silent rank's process ended: that explains every wait (the
                    return self._dead_silent(where, True) or self._describe(*blamed)  # rank blamed may wait on it)
                return self._describe(*blamed)
            if peer is None and not timed_out:  # a collective lost a connection: a process ended; if it is a
                dead = self._dead_silent(where, False)  # silent rank's on this machine, that is the verdict now
                if dead is not None:
                    return dead
            if time.monotonic() >= deadline:
                return self._dead_silent(where, timed_out)
            time.sleep(_POLL)

    def _dead_silent(self, where: str, timed_out: bool) -> Optional[str]:
        """``"rank P died ..."`` if exactly one other rank published nothing and its process here has ended.

        ``timed_out``: how this rank's wait in ``where`` ended (timed out, or lost a connection).
        """
        dead = [(rank, local[0]) for rank in self._silent()
                if (local := self._local_process(rank)) is not None and _gone(*local)]
        if len(dead) != 1:
            return None
        rank, pid = dead[0]
        how = "timed out" if timed_out else "lost a connection"
        return (f"rank {rank} died: its process (pid {pid} on this machine) ended without raising an error "
                f"(found when rank {self.rank}'s wait in {where} {how})")

    def _local_process(self, rank: int) -> Optional[tuple[int, str]]:
        """``(pid, start time)`` of ``rank``'s process if it runs on this machine (as written at construction)."""
        identity = self._get(f"pipe/{self.instance}/process/{rank}")
        if identity is None:
            return None
        host, pid, start = identity.split(" ")
        return (int(pid), start) if host == socket.gethostname() else None

    def _only_silent(self) -> Optional[int]:
        """The one rank that published nothing this step, once all the others have (one counter read till then)."""
        if self._reported() < self.world - 1:
            return None
        silent = self._silent()
        return silent[0] if len(silent) == 1 else None

    def _follow(self, peer: Optional[int]) -> Optional[tuple[int, bool, str]]:
        """From ``peer`` along the lost-contact records to the rank to blame: ``(rank, stalled, seen by)``.

        The chain ends at a rank that published nothing (it died or stalled).
        A record whose peer is not known (``?``: a collective failed) leads to
        the one rank that published nothing, if only one did. If the chain
        comes back to a rank already visited, the ranks lost each other: a wait
        that timed out closes the connection, so the other end sees it closed;
        the rank that one timed out on is the one to blame.
        """
        if peer is None:
            return None
        mine = self._get(self._key(f"lost/{self.rank}"))
        if mine is None:
            return None
        edges: list[tuple[int, int, bool, str]] = []  # (rank, the peer it lost, timed out, where)
        _, how, where = mine.split(" ", 2)
        rank, timed_out = self.rank, how == "timeout"
        visited = {self.rank}
        while True:
            edges.append((rank, peer, timed_out, where))
            if peer in visited:
                stalls = [(blamed, by, at) for by, blamed, out, at in edges if out]
                if not stalls:
                    return None
                blamed, by, at = stalls[0]
                return blamed, True, f"rank {by} in {at}"
            visited.add(peer)
            record = self._get(self._key(f"lost/{peer}"))
            if record is None:
                return peer, timed_out, f"rank {rank} in {where}"
            next_peer, how, next_where = record.split(" ", 2)
            if next_peer == "?":
                found = self._only_silent()
                if found is None:
                    return None
                next_peer = str(found)
            rank, timed_out, where, peer = peer, how == "timeout", next_where, int(next_peer)

    def _describe(self, rank: int, timed_out: bool, seen: str) -> str:
        if not timed_out:
            return (f"rank {rank} died: its process ended without raising an error (killed, or exited; "
                    f"its connection closed, seen by {seen})")
        local = self._local_process(rank)
        stopped = ""
        if local is not None:
            pid, start = local
            if _gone(pid, start):  # gloo's collectives may time out
                return (f"rank {rank} died: its process (pid {pid} on this machine) ended without raising an "
                        f"error (a wait on it timed out, seen by {seen})")
            if _stopped(pid) and _start_time(pid) == start:
                stopped = (f"; its process (pid {pid} on this machine) is stopped (SIGSTOP?) and was ended "
                           "with SIGKILL so that the job ends now")
                self._stopped_peer = pid  # ended once the verdict is agreed (see failure_from)
        return (f"rank {rank} stalled: it did not answer within the {self.timeout:g} s timeout "
                f"(seen by {seen}){stopped}")


@contextmanager
def naming_failures(where: str, timeout: float) -> Iterator[None]:
    """Runs a collective operation of every rank (a save) so that a failure in it is named as in a step.

    A rank that dies, stalls or raises inside the block is named on every
    other rank with the step's words and exception type
    (``PipelineFailure: rank 0 stopped in state.save because rank 2 died: ...``),
    as fast as in a step: the evidence goes to a namespace of this call in
    the store, and once a rank has named the failure it shuts down the
    connections of the checkpoints' groups (:func:`pipe.distributed.connections.abort`),
    so that no partner waits for the timeout. Every rank of the job calls it
    alike (the namespaces are numbered in call order).

    Args:
        where: what the block does, named in the verdicts (``"state.save"``).
        timeout: the job's timeout in seconds.
    """
    if not dist.is_initialized():
        yield
        return
    failures = Failures(dist.get_rank(), dist.get_world_size(), timeout, kind="checkpoints")
    failures.begin_step()
    try:
        yield
    except BaseException as error:
        raise failures.failure_from(where, error) from None
    finally:
        failures.end_step()


_CLOSED = ("connection closed", "connection reset", "broken pipe", "socket closed", "connection refused",
           "end of file")  # gloo's words for a peer whose process ended (its sockets closed)


def _peer_of(error: BaseException) -> Optional[tuple[Optional[int], bool]]:
    """``(peer, timed out)`` if ``error`` is a lost connection or a timeout, else None (the peer None if not known).

    A collective's lost connection names the peer's address, which leads to
    its rank where pipe made the group (:func:`pipe.distributed.connections.rank_at`).
    """
    if isinstance(error, PeerError):
        return error.peer, error.timed_out
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(error).lower()
    timed_out = "timed out" in text or "timeout" in text
    if (backend_error is not None and isinstance(error, backend_error)) or (
            isinstance(error, RuntimeError) and (timed_out or any(words in text for words in _CLOSED))):
        return (None if timed_out else connections.rank_at(error)), timed_out
    return None
