"""Point-to-point transport: send a micro-batch value to another rank, structure and all.

A stage's output is any value of tensors, tuples, lists, dicts and plain
Python values (:mod:`pipe.core.microbatch`), and its shapes change from one
micro-batch to the next (an uneven last micro-batch, a different batch size
next step). A receiver cannot allocate buffers for what it does not know, so
every message starts with a small header that says what follows::

    sender                                    receiver
    header  [uint8 x HEADER_BYTES] ───────▶   irecv(header)      (posted ahead)
            8-byte length + pickled (structure, non-tensor leaves,
            dtype/shape/requires_grad of each tensor)
    [rest of a long header]        ───────▶   irecv(rest)        (only if longer)
    tensor 0 .. tensor n-1         ───────▶   irecv(empty(shape, dtype)) x n

A tensor's bytes move only once its receive is posted, and a receive posted
when the header arrives puts the whole transfer on the critical path (about
3% of a step on the P5 benchmark). So on gloo the receiver also posts the
tensor receives *with the header's*, guessing the layout (dtypes and shapes)
that the same channel and micro-batch had last time, which both ends
remember. The header says whether the guess held: if it did, the tensors are
already arriving into the guessed buffers; if not (the first step, a new
batch size), the sender completes the guessed receives with empty messages
(gloo accepts a shorter message) and sends the tensors on tags of their own.

Messages travel on *channels*: one process group per (pipeline replica,
stage boundary or skip route, direction), so that backends that match
messages in posting order (NCCL) see the same order on both ends; gloo also
gets a distinct tag per micro-batch and slot. The pipelines of one process
share their groups (:func:`pipe.distributed.mesh.reuse`), so each transport
(one per ``DistributedPipe``, numbered alike on every rank) has tags of its
own: a pipeline rebuilt after a failed step never meets a message or a
posted receive that the broken one left behind. Sends are asynchronous
(``isend``) and complete in the background while the sender computes; the
sender only waits for them at the end of a step. A message between two stages
of one rank (interleaved schedules with one rank) never touches the network.

When the guess holds, two more things repeat, and gloo is spared work per
message (each message costs tens of microseconds of posting and waiting,
which dominates a step of a small model):

* the header: if the structure, the Python leaves and the tensors' metadata
  are those of the channel's last message, the header is 8 bytes saying so,
  and neither end pickles (both ends keep the last header of each channel and
  micro-batch, as they keep the layouts);
* small values travel *inline*: if the guessed layout holds at most
  ``INLINE_BYTES``, the receiver posts one buffer of ``HEADER_BYTES`` plus
  the tensors' bytes instead of a header and a receive per tensor, and the
  sender copies the tensors behind the header: one message per value, as
  ``torch.distributed.pipelining`` sends once it knows the shapes. The
  receiver copies them out and frees the buffer.

The pickled header is the same mechanism as ``torch.distributed``'s
``send_object_list``: the peers are ranks of one job.

Gloo's point-to-point ops take host memory only (a CUDA tensor's address
reaches the socket as is: "Bad address"). So on gloo the *wire* is the CPU
whatever the rank's device: a GPU rank copies each tensor to the host before
it sends, receives into host buffers and moves the values to its device. NCCL
sends from and into device memory.
"""
from __future__ import annotations

import collections
import datetime
import functools
import itertools
import logging
import time
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from pipe import trace
from pipe.distributed import watchdog
from pipe.trace.events import Cell
from pipe.core.message import HEADER_BYTES, INLINE_BYTES
from pipe.core.microbatch import flatten, unflatten

__all__: list[str] = []

logger = logging.getLogger(__name__)

_SLOTS = 4096  # messages (header, rest, tensors) per micro-batch on one channel
_MICROBATCHES = 8192  # micro-batches per step a transport can tell apart
_TRANSPORTS = (2**31) // (_SLOTS * _MICROBATCHES)  # transports with tags of their own (tags are C ints)
_transports = itertools.count()
_MISSED = 2 + (_SLOTS - 2) // 2  # first tag of the tensors when the receiver guessed another layout
_LENGTH_BYTES = 8
_REPEAT = 2**64 - 1  # the length field of a header that repeats the channel's last one
_ALIGN = 16  # inline tensors start at multiples of this many bytes

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # dtype and shape of each tensor of a message
Meta = tuple[torch.dtype, tuple[int, ...], bool]  # dtype, shape and requires_grad of a tensor of a message
Header = tuple[Any, list[Any], list[Meta]]  # structure, leaves (tensors as _TENSOR) and tensor metadata
_PLAIN = (type(None), bool, int, str)  # Python leaves compared by value for a repeated header (float: by hex)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@functools.lru_cache(maxsize=1024)
def inline_offsets(layout: Layout) -> Optional[tuple[int, ...]]:
    """Byte offsets of the tensors of ``layout`` behind the header, then the total; None if too large to inline."""
    offsets, total = [], 0
    for dtype, shape in layout:
        offsets.append(total)
        total += -(-_numel(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return (*offsets, total) if total <= INLINE_BYTES else None


def _same_header(a: Header, b: Header) -> bool:
    """Whether header ``b`` says what ``a`` said, so that the receiver's copy of ``a`` stands for it."""
    if a[2] != b[2] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1]):
        if x is y:
            continue
        if type(x) is not type(y) or not (x.hex() == y.hex() if type(x) is float else
                                          type(x) in _PLAIN and x == y):
            return False
    return a[0] is b[0] or repr(a[0]) == repr(b[0])  # repr: dict keys 1 and True are ==, not alike


class PeerError(RuntimeError):
    """A message to or from ``peer`` failed: its connection closed, or it did not answer in time.

    The failure of this rank is then a consequence of the peer's (or of a rank
    the peer waits for): :mod:`pipe.distributed.failure` works out which.
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer
        self.timed_out = "timed out" in message.lower() or "timeout" in message.lower()


class OutOfStep(RuntimeError):
    """The two ends of a channel disagree on what was sent (an earlier step failed half-way)."""


@dataclass(frozen=True)
class Channel:
    """Where a message goes: the peer's global rank, the process group and a tag base.

    ``group`` is None for a loopback channel (sender and receiver are one rank).
    """

    peer: int
    group: Optional[dist.ProcessGroup]
    name: str

    @functools.cached_property
    def group_peer(self) -> int:
        """The peer's rank within ``group``."""
        if not isinstance(self.group, dist.ProcessGroup):
            raise RuntimeError(f"channel {self.name}: this rank is not in the channel's group")
        return dist.get_group_rank(self.group, self.peer)

    def isend(self, tensor: Tensor, tag: int) -> dist.Work:
        """``dist.isend(tensor, peer, group, tag)`` without its checks per call (the channel is this rank's)."""
        assert self.group is not None
        return self.group.send([torch.view_as_real(tensor) if tensor.is_complex() else tensor], self.group_peer, tag)

    def irecv(self, tensor: Tensor, tag: int) -> dist.Work:
        """``dist.irecv(tensor, peer, group, tag)`` without its checks per call."""
        assert self.group is not None
        return self.group.recv([torch.view_as_real(tensor) if tensor.is_complex() else tensor], self.group_peer, tag)


class Incoming:
    """A message being received: header and guessed tensors are posted at once, the others when it arrives."""

    def __init__(self, transport: "Transport", channel: Channel, tag: int, cell: Cell = None) -> None:
        self.transport = transport
        self.channel = channel
        self.tag = tag
        self.cell = cell
        self._work: Optional[dist.Work] = None
        # The guessed layout, its buffers and their receives, or its bytes behind the header (inline).
        self._guess: Optional[Layout] = transport._received.get((channel.name, tag))
        self._guessed: list[tuple[Tensor, dist.Work]] = []
        self._inline = inline_offsets(self._guess) if self._guess is not None else None
        extra = self._inline[-1] if self._inline is not None else 0
        self._header: Optional[Tensor] = None
        if channel.group is not None:
            self._header = torch.empty(HEADER_BYTES + extra, dtype=torch.uint8, device=transport.wire)
            try:
                self._work = channel.irecv(self._header, tag)
                for k, (dtype, shape) in enumerate(self._guess if self._inline is None and self._guess else ()):
                    buffer = torch.empty(shape, dtype=dtype, device=transport.wire)
                    self._guessed.append(
                        (buffer, channel.irecv(buffer, tag + 2 + k)))
            except RuntimeError as error:
                raise self._failed(error) from error

    def __str__(self) -> str:
        return (f"receiving {self.channel.name} of micro-batch {(self.tag - self.transport._first_tag) // _SLOTS} "
                f"from rank {self.channel.peer}")

    def _failed(self, error: RuntimeError) -> RuntimeError:
        return PeerError(f"{self} failed: {error}", self.channel.peer)

    def _await(self, work: dist.Work) -> None:
        """``work.wait`` within the transport's timeout, watched (:func:`pipe.distributed.watchdog.waiting`)."""
        timeout = self.transport.timeout
        with watchdog.waiting(self, timeout.total_seconds()):
            work.wait(timeout)

    def wait(self) -> Any:
        """Blocks until the whole message is here and returns its value."""
        channel = self.channel
        if channel.group is None:
            return self.transport._loopback.pop((channel.name, self.tag))
        try:
            return self._wait()
        except OutOfStep:
            raise  # not a lost peer: the two ranks disagree on what was sent
        except RuntimeError as error:
            raise self._failed(error) from error

    def _wait(self) -> Any:
        channel, transport = self.channel, self.transport
        key = (channel.name, self.tag)
        with trace.span("recv", self.cell, channel=channel.name):
            assert self._work is not None and self._header is not None
            started = time.perf_counter()
            self._await(self._work)
            buffer, self._header = self._header, None  # the buffer goes once the tensors are out
            header = buffer[:HEADER_BYTES].cpu()
            length = int.from_bytes(header[:_LENGTH_BYTES].numpy().tobytes(), "little")
            if length == _REPEAT:  # the channel's last header again: the guess held
                cached = transport._received_headers.get(key)
                if cached is None or self._guess is None:
                    raise OutOfStep("the sender repeated a header this rank never received: the two ranks are out "
                                    "of step (an earlier step failed half-way?); restart the job")
                spec, template, metas = cached
                leaves, guessed, hit = list(template), True, True
            else:
                payload = header[_LENGTH_BYTES:_LENGTH_BYTES + length].numpy().tobytes()
                if length > HEADER_BYTES - _LENGTH_BYTES:
                    rest = torch.empty(length - len(payload), dtype=torch.uint8, device=transport.wire)
                    self._await(channel.irecv(rest, self.tag + 1))
                    payload += rest.cpu().numpy().tobytes()
                spec, leaves, metas, guessed, hit = pickle.loads(payload)
                if transport.guess:
                    transport._received_headers[key] = (spec, list(leaves), metas)
            layout: Layout = tuple((dtype, shape) for dtype, shape, _ in metas)
            if guessed != (self._guess is not None) or (hit and layout != self._guess):
                raise OutOfStep(
                    f"the sender {'expected' if guessed else 'did not expect'} this rank to guess the layout of "
                    "the message, and it did otherwise: the two ranks are out of step (an earlier step failed "
                    "half-way?); restart the job"
                )
            if transport.guess:
                transport._received[key] = layout
            if hit and self._inline is not None:  # the tensors came behind the header: copied out
                buffers = [buffer[HEADER_BYTES + start:].view(dtype)[:_numel(shape)].view(shape).clone()
                           for start, (dtype, shape) in zip(self._inline, layout)]
                works = []
            elif hit:
                buffers = [buffer for buffer, _ in self._guessed]
                works = [work for _, work in self._guessed]
            else:  # the guessed receives get empty messages; the tensors come on tags of their own
                buffers = [torch.empty(shape, dtype=dtype, device=transport.wire) for dtype, shape in layout]
                first = self.tag + (_MISSED if guessed else 2)
                works = [work for _, work in self._guessed] + [
                    channel.irecv(buffer, first + k)
                    for k, buffer in enumerate(buffers)
                ]
            del buffer, header
            for work in works:
                self._await(work)
            transport.stats["wait_s"] += time.perf_counter() - started
        if transport.wire != transport.device:  # gloo on a GPU rank: host buffers to the device
            buffers = [buffer.to(transport.device) for buffer in buffers]
        tensors = iter(buffers)
        flags = iter(requires_grad for _, _, requires_grad in metas)
        for position, leaf in enumerate(leaves):
            if leaf is _TENSOR:
                leaves[position] = next(tensors).requires_grad_(next(flags))
        return unflatten(leaves, spec)


class _TensorMarker:
    """Stands in the header for a tensor leaf, which travels as its own message."""

    def __reduce__(self) -> str:
        return "_TENSOR"


_TENSOR = _TensorMarker()


class Transport:
    """Sends and receives values over channels with asynchronous point-to-point ops.

    Args:
        device: where received tensors are allocated (the rank's device).
        timeout: how long a wait may block before it fails (gloo's point-to-point
            waits have no timeout of their own).
        guess: post tensor receives with the header, guessing the layout of
            the last message of the same channel and micro-batch; default: on
            gloo (NCCL needs a receive's size to match its send's).
    """

    def __init__(self, device: torch.device, timeout: datetime.timedelta, guess: Optional[bool] = None) -> None:
        self.device = device
        self.timeout = timeout
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        self.guess = gloo if guess is None else guess
        self.wire = torch.device("cpu") if gloo else device
        """Where messages are sent from and received into: host memory on gloo, else ``device``."""
        self._pending: list[tuple[dist.Work, list[Tensor], Channel]] = []
        self._loopback: dict[tuple[str, int], Any] = {}
        # The layout of the last message per (channel, tag), sent and received: the guesses. The two
        # ends' records agree, as each message is received once, in the order the messages are sent.
        self._sent: dict[tuple[str, int], Layout] = {}
        self._received: dict[tuple[str, int], Layout] = {}
        self._sent_headers: dict[tuple[str, int], Header] = {}  # and the last header, to repeat it in 8 bytes
        self._received_headers: dict[tuple[str, int], Header] = {}
        self.stats: collections.defaultdict[str, float] = collections.defaultdict(float)
        """``messages``, ``headers`` (pickled), ``repeated_headers`` (8 bytes), ``inline`` (values sent in their
        header's message); ``send_s`` and ``wait_s`` (seconds), for the benchmarks' profiles."""
        self._first_tag = (next(_transports) % _TRANSPORTS) * _MICROBATCHES * _SLOTS

    def tag(self, microbatch: int) -> int:
        """The first tag of ``microbatch``'s message on a channel.

        Raises:
            ValueError: more micro-batches than a transport's tags tell apart.
        """
        if not 0 <= microbatch < _MICROBATCHES:
            raise ValueError(
                f"micro-batch {microbatch}: a step can have at most {_MICROBATCHES} micro-batches between ranks; "
                "use fewer chunks")
        return self._first_tag + microbatch * _SLOTS

    def send(self, value: Any, channel: Channel, microbatch: int, cell: Cell = None) -> None:
        """Starts sending ``value`` (tensors are detached); returns without waiting.

        Raises:
            ValueError: the value holds more tensors than a message can carry.
        """
        leaves, spec = flatten(value)
        tensors = [leaf.detach().to(self.wire) for leaf in leaves if isinstance(leaf, Tensor)]
        tag = self.tag(microbatch)
        if channel.group is None:
            self._loopback[(channel.name, tag)] = unflatten(
                [_loopback_leaf(leaf) for leaf in leaves], spec)
            return
        if len(tensors) > _SLOTS - _MISSED:
            raise ValueError(
                f"a value sent between stages holds {len(tensors)} tensors; at most {_SLOTS - _MISSED} fit one "
                "message (stack them into fewer tensors)"
            )
        metas: list[Meta] = [(t.dtype, tuple(t.shape), t.requires_grad)
                             for t in (leaf for leaf in leaves if isinstance(leaf, Tensor))]
        layout: Layout = tuple((dtype, shape) for dtype, shape, _ in metas)
        key = (channel.name, tag)
        guess = self._sent.get(key)  # the receiver's record is the same: its guess
        hit = guess == layout
        started = time.perf_counter()
        header_leaves = [_TENSOR if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        described: Header = (spec, header_leaves, metas)
        last = self._sent_headers.get(key)  # the receiver's copy of the last header is the same
        if self.guess:
            self._sent[key] = layout
            self._sent_headers[key] = described
        inline = inline_offsets(layout) if hit else None  # the receiver posted room for them
        if hit and last is not None and _same_header(last, described):
            encoded = _REPEAT.to_bytes(_LENGTH_BYTES, "little")
            self.stats["repeated_headers"] += 1
        else:
            payload = pickle.dumps((spec, header_leaves, metas, guess is not None, hit))
            encoded = len(payload).to_bytes(_LENGTH_BYTES, "little") + payload
            self.stats["headers"] += 1
        first = encoded[:HEADER_BYTES]
        header = torch.zeros(HEADER_BYTES + (inline[-1] if inline is not None else 0), dtype=torch.uint8,
                             device=self.wire)
        header[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        if inline is not None:  # the tensors go behind the header, in one message
            for start_byte, tensor in zip(inline, tensors):
                header[HEADER_BYTES + start_byte:].view(tensor.dtype)[:tensor.numel()].view(tensor.shape).copy_(tensor)
            self.stats["inline"] += 1
        messages = [(header, tag)]
        if len(encoded) > HEADER_BYTES:
            rest = torch.frombuffer(bytearray(encoded[HEADER_BYTES:]), dtype=torch.uint8)
            messages.append((rest.to(self.wire), tag + 1))
        if guess is not None and not hit:  # complete the guessed receives, send the tensors on other tags
            if inline_offsets(guess) is None:  # (an inline guess posted no receives of its own)
                messages += [(torch.empty(0, dtype=dtype, device=self.wire), tag + 2 + k)
                             for k, (dtype, _) in enumerate(guess)]
            messages += [(t.contiguous(), tag + _MISSED + k) for k, t in enumerate(tensors)]
        elif inline is None:
            messages += [(t.contiguous(), tag + 2 + k) for k, t in enumerate(tensors)]
        with trace.span("send", cell, channel=channel.name):
            for tensor, message_tag in messages:
                try:
                    work = channel.isend(tensor, message_tag)
                except RuntimeError as error:
                    raise PeerError(
                        f"sending {channel.name} of micro-batch {microbatch} to rank {channel.peer} failed: {error}",
                        channel.peer) from error
                self._pending.append((work, [tensor], channel))
        self._reap()
        self.stats["messages"] += 1
        self.stats["send_s"] += time.perf_counter() - started

    def receive(self, channel: Channel, microbatch: int, cell: Cell = None) -> Incoming:
        """Posts the receive of ``microbatch``'s message; ``.wait()`` returns the value."""
        return Incoming(self, channel, self.tag(microbatch), cell)

    def _reap(self) -> None:
        """Forgets sends that have completed, so their buffers can be freed."""
        self._pending = [entry for entry in self._pending if not entry[0].is_completed()]

    def flush(self) -> None:
        """Waits until every send has completed."""
        pending, self._pending = self._pending, []
        for work, _, channel in pending:
            try:
                with watchdog.waiting(f"sending {channel.name} to rank {channel.peer}", self.timeout.total_seconds()):
                    work.wait(self.timeout)
            except RuntimeError as error:
                raise PeerError(f"sending {channel.name} to rank {channel.peer} failed: {error}",
                                channel.peer) from error
        if self._loopback:
            left = sorted(self._loopback)
            self._loopback.clear()
            raise RuntimeError(f"messages sent to this rank itself were never received: {left}")


def _loopback_leaf(leaf: Any) -> Any:
    """What a local receiver gets: a detached tensor with the sender's requires_grad."""
    if isinstance(leaf, Tensor):
        return leaf.detach().requires_grad_(leaf.requires_grad)
    return leaf
