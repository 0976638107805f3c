"""The connections of pipe's gloo process groups: recorded as the groups are made, shut down after a failure.

Nothing in torch interrupts a gloo wait: ``ProcessGroup.abort()``,
``shutdown()`` and ``destroy_process_group`` return, and the wait (a posted
receive, a collective running on the group's worker thread) goes on until
its peer's connection closes or its timeout passes. A collective still
running at exit holds the process until then: its worker thread is joined
in the interpreter's teardown, and a peer that is alive but will never take
part (it raised, or is blocked itself) releases it only when its own
process ends. And a rank blocked in a collective with a live partner hears
of a death elsewhere only at the timeout.

So pipe records, for each group it makes (:func:`recording`: a pipeline's
channels, the mesh of :func:`pipe.distributed.make_mesh`, the checkpoints'
groups: a save's, and the one asynchronous saves write over), the TCP connections that gloo opened for it (the process's sockets
before and after, read from ``/proc/self/fd`` and ``/proc/self/net/tcp``),
and publishes in the job's store which rank holds each connection's end
(``pipe/endpoint/<address>:<port>`` -> rank) the address each group listens
on: gloo's error names the peer's (``Connection closed by peer [10.0.0.2]:41234``), so a
rank whose collective lost a peer learns which rank it was
(:func:`rank_at`). Once a failure is named, :func:`abort` shuts those
connections down (``shutdown(SHUT_RDWR)``): every wait posted on them, here
and at the other end, fails at once with "Connection closed by peer", so the
partners blocked on this rank go on to read the agreed headline, and no
collective is left running to hold the process at exit.

The default group (``init_process_group``'s) is never recorded and never
shut down: a rebuilt pipeline agrees on its configuration over it. Groups
made elsewhere (a mesh of one's own ``init_device_mesh``) are not recorded
either: their waits end at their timeout, as before. Without ``/proc``
(not Linux) nothing is recorded.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

__all__: list[str] = []

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ESTABLISHED, _LISTEN = "01", "0A"
_ENDPOINT = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")  # gloo's way of writing a peer's end: [127.0.0.1]:41234
_recorded: dict[str, set[str]] = {}  # kind -> the socket inodes of the groups made through recording()
_lock = threading.Lock()


def job_store() -> Optional[dist.Store]:
    """The job's key-value store (the default group's), or None without one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _socket_fds() -> dict[str, int]:
    """This process's sockets: inode -> a file descriptor of it (empty without ``/proc``)."""
    found: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.setdefault(target[8:-1], int(name))
    return found


def _address(field: str) -> str:
    """``0100007F:A8EC`` (``/proc/net/tcp``'s little-endian words) as ``127.0.0.1:43244``."""
    hexed, port = field.split(":")
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return f"{address}:{int(port, 16)}"


def _ends(inodes: set[str]) -> dict[str, tuple[str, str]]:
    """Of ``inodes``, the TCP sockets: inode -> (state, this end's ``address:port``)."""
    ends: dict[str, tuple[str, str]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[9] in inodes:
                ends[fields[9]] = (fields[3], _address(fields[1]))
    return ends


def recording(make: Callable[[], T], kind: str) -> T:
    """``make()``, recording the connections it opened as groups of ``kind`` (``abort(kind)`` shuts them down).

    For calls that make gloo process groups (every member connects to every
    other as the group is made). ``kind``: ``"pipeline"`` (a pipeline's
    channels and mesh) or ``"checkpoints"`` (the groups saves and their background writes run on). Each
    connection's end is published as this rank's (:func:`rank_at`).
    """
    before = set(_socket_fds())
    made = make()
    new = set(_socket_fds()) - before
    if not new:
        return made
    ends = _ends(new)
    with _lock:
        _recorded.setdefault(kind, set()).update(inode for inode, (state, _) in ends.items() if state == _ESTABLISHED)
    store = job_store()
    if store is not None and dist.is_initialized():
        rank = str(dist.get_rank())
        for state, end in ends.values():
            try:
                store.set(f"pipe/endpoint/{end}", rank)
            except Exception:  # the peers then find the rank by the default rule (the silent one)
                logger.debug("could not publish the listening address %s", end, exc_info=True)
    return made


def rank_at(error: BaseException) -> Optional[int]:
    """The rank whose address gloo's ``error`` names (``... closed by peer [addr]:port``), if it was published.

    Gloo names the address its peer listens on, the port with its two bytes
    swapped (torch 2.13's gloo): both readings are looked up.
    """
    found = _ENDPOINT.search(str(error))
    store = job_store()
    if found is None or store is None:
        return None
    try:
        address, port = ipaddress.ip_address(found.group(1)), int(found.group(2))
    except ValueError:
        return None
    for candidate in (port, int.from_bytes(port.to_bytes(2, "little"), "big") if port < 65536 else port):
        key = f"pipe/endpoint/{address}:{candidate}"
        try:
            if store.check([key]):
                return int(store.get(key).decode())
        except Exception:
            return None
    return None


def abort(kind: str) -> int:
    """Shuts down every recorded connection of ``kind`` still open in this process; returns how many.

    Every wait posted on them fails at once, on this rank and on its peers
    ("Connection closed by peer"); their groups can carry nothing more (a
    rebuilt pipeline makes new ones, :func:`pipe.distributed.mesh.spoil_reused`).
    """
    with _lock:
        recorded = _recorded.pop(kind, set())
    count = 0
    for inode, fd in _socket_fds().items():
        if inode not in recorded:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:  # the dup is closed; gloo's descriptor stays
                sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:  # closed meanwhile, or no longer connected
            continue
    if count:
        logger.info("shut down %d connection(s) of the %s groups, so that no wait on them outlives the failure",
                    count, kind)
    return count


def _forget_in_child() -> None:
    """A forked child holds copies of its parent's sockets: they are not its groups' to shut down."""
    _recorded.clear()


os.register_at_fork(after_in_child=_forget_in_child)
