"""The lci:// wire format: parcels to bytes, and bytes back to parcels.

Sans-I/O: nothing here touches a socket, a thread or an event loop, so the
whole protocol can be tested on its own with plain bytes.

Every network message starts with the same 24-byte header (little-endian)::

    magic "LCIP" | version u8 | kind u8 | flags u16 | vc u32 | seq u64 | count u32

``version`` is :data:`VERSION` (2); ``flags`` are reserved and must be 0.
``vc`` names the virtual connection (one Dask comm) the message belongs to and
``seq`` numbers the parcels of one direction of it. What ``count`` means, and
what follows the header, depends on the kind:

``HELLO``     count = payload length; the payload (opaque, bounded) follows.
``CONNECT``   opens virtual connection ``vc``; count = 0, no body.
``CLOSE``     closes virtual connection ``vc``; count = 0, no body.
``PARCEL``    one Dask message. count = number of frames, then one u64 per
              frame (its *size word*), then the eager (non-bulk) frames,
              back to back in order.
``FRAGMENT``  a piece of a bulk frame. count = frame index, then
              ``offset u64 | nbytes u64`` and ``nbytes`` (> 0) of data, which
              the receiver writes straight into the frame's buffer (the
              one-sided put of LCI, emulated over a byte stream).
``PLACED``    one bulk group, already written by the sender into memory the
              receiver shares with it (a true one-sided put). count = index
              of the group's first frame, then
              ``handle u64 | offset u64 | nbytes u64``: where the group's
              frames lie, back to back, in the receiver's terms (see
              ``placement`` of :class:`ParcelDecoder`); ``nbytes`` is the
              group's total size.

A size word is ``BULK (bit 63) | SHARE (bit 62) | size (bits 0-61)``: BULK
marks a bulk frame, which follows the parcel; SHARE a frame that shares the
receive buffer of the previous non-empty frame. An empty frame has neither.

The sender decides which frames the receiver keeps in one buffer. A *group* is
a non-empty frame without SHARE and the non-empty frames with SHARE after it,
up to the next non-empty frame without SHARE; empty frames belong to no group
and are received as empty views. Each group is received into a buffer of its
own, its frames back to back, so that releasing one object frees its memory
whatever became of the others (the sender groups frames as Dask's tcp comm
does, except that an object above the eager threshold never shares the
header's buffer, see :func:`shares_buffer`). A group is all eager or all bulk.

The bulk groups of a parcel follow it in order, before the next parcel of the
same virtual connection: each either as one PLACED record, or as the
fragments of its frames, frame after frame, each frame in order from offset 0
to its end; the groups of one parcel may mix the two. Units of different virtual
connections may interleave, which is what keeps small messages flowing past a
large one. SHARE on the first non-empty frame, a group mixing eager and bulk
frames, a flag on an empty frame, a fragment that does not continue the frame
due, or a PLACED record that is not for the next bulk group (none of it sent)
or not of its size is a protocol error. Every length read off the wire is
checked against :class:`Limits` before anything is allocated from it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pickle import PickleBuffer

import numpy as np

from dask_lcicomm.packet_pool import packet_pool

MAGIC = b"LCIP"
VERSION = 2
HEADER = struct.Struct("<4sBBHIQI")
FRAGMENT_EXT = struct.Struct("<QQ")
PLACED_EXT = struct.Struct("<QQQ")
#: Size-table flags: the frame is bulk; the frame shares the receive buffer of
#: the previous non-empty frame. The low 62 bits are the frame's size.
BULK = 1 << 63
SHARE = 1 << 62
SIZE_MASK = SHARE - 1
MAX_HELLO_BYTES = 64 * 1024
MAX_VC = (1 << 32) - 1

Buffer = bytes | bytearray | memoryview
#: Where the receiver finds a placed group: ``(handle, offset, nbytes)`` to a
#: buffer of ``nbytes``; raises :class:`ProtocolError` for a bad location.
Placement = Callable[[int, int, int], memoryview]


class Kind(IntEnum):
    HELLO = 1
    CONNECT = 2
    CLOSE = 3
    PARCEL = 4
    FRAGMENT = 5
    PLACED = 6


_PARCEL, _FRAGMENT, _HELLO = int(Kind.PARCEL), int(Kind.FRAGMENT), int(Kind.HELLO)
_PLACED = int(Kind.PLACED)
_CONNECT, _CLOSE = int(Kind.CONNECT), int(Kind.CLOSE)

#: Compiled size tables, and parcel headers followed by one, for the frame
#: counts most messages have.
_SIZE_TABLES = {n: struct.Struct(f"<{n}Q") for n in range(33)}
_PARCEL_HEADS = {n: struct.Struct(f"{HEADER.format}{n}Q") for n in range(33)}
#: The same as pairs of u32 (low word, high word). In the size table of one
#: eager group of frames under 4 GiB the high words are constant (SHARE on
#: every frame but the first), so the common small message is written and
#: recognised without a loop over its frames.
_WORD_TABLES = {n: struct.Struct(f"<{2 * n}I") for n in range(33)}
_WORD_HEADS = {n: struct.Struct(f"{HEADER.format}{2 * n}I") for n in range(33)}

#: A parcel whose frames total at most this many bytes is sent as one buffer,
#: its frames copied behind the head: below this size the copy costs less than
#: a buffer per frame in every layer below (send queue, ring or ``sendmsg``).
JOIN_BYTES = 32 * 1024

#: Empty frames are slices of this (each its own view, so that releasing one
#: harms no other).
_NOTHING = memoryview(bytearray())


def _size_table(nframes: int) -> struct.Struct:
    table = _SIZE_TABLES.get(nframes)
    return table if table is not None else struct.Struct(f"<{nframes}Q")


def _parcel_head(nframes: int) -> struct.Struct:
    head = _PARCEL_HEADS.get(nframes)
    return head if head is not None else struct.Struct(f"{HEADER.format}{nframes}Q")


def _word_table(nframes: int) -> struct.Struct:
    table = _WORD_TABLES.get(nframes)
    return table if table is not None else struct.Struct(f"<{2 * nframes}I")


def _word_head(nframes: int) -> struct.Struct:
    head = _WORD_HEADS.get(nframes)
    return head if head is not None else struct.Struct(f"{HEADER.format}{2 * nframes}I")


def _one_group(nframes: int) -> list[int]:
    """The size table of one eager group of ``nframes`` frames under 4 GiB, as
    u32 words, with the sizes (the low words) left 0."""
    return [0, 0, *(0, SHARE >> 32) * (nframes - 1)]


_ONE_GROUP = {n: _one_group(n) for n in range(1, 33)}
_ONE_GROUP_HIGH = {n: tuple(words[1::2]) for n, words in _ONE_GROUP.items()}
_SHARE_HIGH = SHARE >> 32
_OR_SHARE = SHARE.__or__
_ONE_FRAME_HEAD = _PARCEL_HEADS[1]


class ProtocolError(ValueError):
    """The peer sent something that is not a valid parcel stream."""


class MessageTooLarge(ValueError):
    """A message the peer's :class:`Limits` would refuse; nothing was sent."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may make us allocate."""

    max_message_bytes: int = 64 << 30
    max_frames: int = 1 << 20
    max_eager_bytes: int = 64 << 20


@dataclass(slots=True)
class Hello:
    payload: bytes


@dataclass(slots=True)
class Connect:
    vc: int


@dataclass(slots=True)
class Close:
    vc: int


@dataclass(slots=True)
class Message:
    vc: int
    seq: int
    frames: list[memoryview]


Event = Hello | Connect | Close | Message


def _control(kind: Kind, vc: int, count: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, vc, 0, count)


def encode_hello(payload: bytes) -> bytes:
    if len(payload) > MAX_HELLO_BYTES:
        raise ValueError(f"hello payload of {len(payload)} bytes is too large")
    return _control(Kind.HELLO, 0, len(payload)) + payload


def encode_connect(vc: int) -> bytes:
    return _control(Kind.CONNECT, vc)


def encode_close(vc: int) -> bytes:
    return _control(Kind.CLOSE, vc)


def _as_bytes_view(frame: Buffer) -> memoryview:
    """A flat byte view of ``frame`` in memory order, without copying when possible."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.nbytes:
        return memoryview(b"")
    if view.contiguous:
        return PickleBuffer(view).raw()
    return memoryview(view.tobytes())


def _as_memoryview(view: Buffer) -> memoryview:
    return view if type(view) is memoryview else memoryview(view)


def _buffer(frame: Buffer) -> object:
    """The object whose memory ``frame`` is (Dask's notion of a frame's buffer)."""
    return frame.obj if isinstance(frame, memoryview) else frame


def _plan(
    frames: Sequence[Buffer], join_limit: float = math.inf
) -> tuple[list[Buffer], list[int], list[int]]:
    """How ``frames`` are received: the frames as flat bytes (``bytes`` frames
    as they are, the others as byte views), their sizes, and the index of the
    first frame of each group. Every other non-empty frame shares the receive
    buffer of the previous non-empty frame.

    A frame shares the previous non-empty frame's buffer

    * while it belongs to the leading group of Dask's tcp comm
      (``distributed.comm.tcp._add_frames_header``): frames whose buffer
      (``.obj`` of a memoryview, else the frame itself) is ``bytes`` are
      header-like; the first other buffer joins them if the bytes before it
      total at most ``max(2048, 0.05 * n)``, ``n`` the size of its frame, and
      that frame is at most ``join_limit`` (the sender's eager threshold: a
      larger object gets a buffer, or a shared-memory pool block, of exactly
      its own size), and so do later frames of that same buffer (its shards)
      and header-like frames; the first frame of another non-``bytes``
      buffer ends the group;
    * or when its buffer is that of the previous non-empty frame (shards of
      one object, which Dask joins without a copy when they lie back to back).
    """
    views: list[Buffer] = []
    sizes: list[int] = []
    header = 0  # bytes of the leading group so far
    first: object = None  # the leading group's non-bytes buffer
    for frame in frames:
        if type(frame) is bytes:
            views.append(frame)
            n = len(frame)
            sizes.append(n)
            header += n
            continue
        view = _as_bytes_view(frame)
        n = view.nbytes
        buffer: object = frame.obj if isinstance(frame, memoryview) else frame
        if not isinstance(buffer, bytes):
            if first is None:
                if (header > 2048 and header > n * 0.05) or n > join_limit:
                    break
                first = buffer
            elif buffer is not first:
                break
        views.append(view)
        sizes.append(n)
        header += n
    else:
        # one leading group
        starts = [0] if sizes and sizes[0] else [index for index, n in enumerate(sizes) if n][:1]
        return views, sizes, starts
    # The leading group, then a group per object (or run of its shards),
    # starting with the frame that ended the leading group.
    starts = [0] if sizes and sizes[0] else [index for index, n in enumerate(sizes) if n][:1]
    if n:
        starts.append(len(sizes))
        previous = buffer  # the buffer of the previous non-empty frame
    else:
        previous = next((_buffer(frames[i]) for i in range(len(sizes) - 1, -1, -1) if sizes[i]), None)
    views.append(view)
    sizes.append(n)
    for index in range(len(sizes), len(frames)):
        frame = frames[index]
        if type(frame) is bytes:
            views.append(frame)
            n = len(frame)
            buffer = frame
        else:
            view = _as_bytes_view(frame)
            views.append(view)
            n = view.nbytes
            buffer = _buffer(frame)
        sizes.append(n)
        if n:
            if buffer is not previous:
                starts.append(index)
            previous = buffer
    return views, sizes, starts


def shares_buffer(frames: Sequence[Buffer], join_limit: float = math.inf) -> list[bool]:
    """For each frame, whether the receiver puts it into the buffer of the
    previous non-empty frame (never for an empty frame or the first non-empty
    one); every other non-empty frame starts a buffer of its own.

    The rule is Dask's tcp comm's, plus shards, and no object larger than
    ``join_limit`` shares the header's buffer: see :func:`_plan`.
    """
    _, sizes, starts = _plan(frames, join_limit)
    own = set(starts)
    return [bool(n) and index not in own for index, n in enumerate(sizes)]


class OutgoingParcel:
    """One message being sent, cut into units that go out whole.

    The first unit is the parcel itself (header, sizes and eager frames); then
    for each bulk group either its PLACED record (see :meth:`place`) or one
    unit per fragment of each of its frames. A sender interleaves the units of
    different virtual connections but sends those of one parcel in order.

    Frames are grouped into receive buffers by :func:`shares_buffer`. A group
    is eager when none of its frames is larger than ``eager_threshold`` and
    the parcel's inline part (size table and eager groups) stays within
    ``eager_budget``; the other groups go bulk.

    ``eager_budget``, ``max_frames`` and ``max_message_bytes`` are the
    *receiver's* :class:`Limits`; a message those would refuse raises
    :class:`MessageTooLarge` here instead.
    """

    __slots__ = (
        "vc", "seq", "nbytes", "_head", "_bulk", "_placed", "_fragment", "_group", "_frame", "_offset",
    )

    def __init__(
        self,
        vc: int,
        seq: int,
        frames: Sequence[Buffer],
        eager_threshold: int,
        fragment_size: int,
        eager_budget: int = Limits.max_eager_bytes,
        *,
        max_frames: int = Limits.max_frames,
        max_message_bytes: int = Limits.max_message_bytes,
    ) -> None:
        if fragment_size < 1:
            raise ValueError(f"fragment_size must be positive, got {fragment_size}")
        nframes = len(frames)
        if nframes > max_frames or 8 * nframes > eager_budget:
            raise MessageTooLarge(
                f"a message of {nframes} frames exceeds the peer's limits"
                f" ({max_frames} frames, {eager_budget} eager bytes)"
            )
        views, sizes, starts = _plan(frames, eager_threshold)
        nbytes = sum(sizes)
        if nbytes > max_message_bytes or nbytes >= SHARE:
            raise MessageTooLarge(
                f"a message of {nbytes} bytes exceeds the peer's limit of {max_message_bytes}"
            )
        budget = eager_budget - 8 * nframes
        bulk: list[list[tuple[int, memoryview]]] = []
        if (
            nframes
            and nbytes <= budget
            and nbytes < 1 << 32
            and 0 not in sizes
            and max(sizes) <= eager_threshold
        ):
            # Every group eager, no frame empty: the common small message.
            if nframes == 1:
                head = _ONE_FRAME_HEAD.pack(MAGIC, VERSION, _PARCEL, 0, vc, seq, 1, nbytes)
            else:
                words = (_ONE_GROUP.get(nframes) or _one_group(nframes)).copy()
                words[::2] = sizes
                if len(starts) > 1:
                    for index in starts[1:]:
                        words[2 * index + 1] = 0
                packer = _WORD_HEADS.get(nframes) or _word_head(nframes)
                head = packer.pack(MAGIC, VERSION, _PARCEL, 0, vc, seq, nframes, *words)
            self._head: list[Buffer] | None = (
                [b"".join((head, *views))] if nbytes <= JOIN_BYTES else [head, *views]
            )
        else:
            eager = []
            starts.append(nframes)
            for group in range(len(starts) - 1):
                first, stop = starts[group], starts[group + 1]
                if stop - first == 1:  # one frame: most groups but the first
                    n = sizes[first]
                    if n <= eager_threshold and n <= budget:
                        budget -= n
                        eager.append(views[first])
                    else:
                        sizes[first] = n | BULK
                        bulk.append([(first, _as_memoryview(views[first]))])
                    continue
                chunk = sizes[first:stop]
                total = sum(chunk)
                if max(chunk) <= eager_threshold and total <= budget:
                    budget -= total
                    if 0 in chunk:
                        eager.append(views[first])
                        for i in range(first + 1, stop):
                            if sizes[i]:
                                sizes[i] |= SHARE
                                eager.append(views[i])
                    else:
                        sizes[first + 1 : stop] = map(_OR_SHARE, chunk[1:])
                        eager += views[first:stop]
                    continue
                members = [i for i in range(first, stop) if sizes[i]]
                sizes[first] |= BULK
                for i in members[1:]:
                    sizes[i] |= BULK | SHARE
                bulk.append([(i, _as_memoryview(views[i])) for i in members])
            head = _parcel_head(nframes).pack(MAGIC, VERSION, _PARCEL, 0, vc, seq, nframes, *sizes)
            self._head = [head, *eager]
        self.vc = vc
        self.seq = seq
        self.nbytes = nbytes
        self._bulk = bulk
        self._placed: list[bytes | None] | None = None
        self._fragment = fragment_size
        self._group = 0
        self._frame = 0
        self._offset = 0

    @property
    def bulk_groups(self) -> list[list[memoryview]]:
        """The frames of each bulk group, in order: what :meth:`place` expects
        to find written back to back."""
        return [[view for _, view in group] for group in self._bulk]

    def place(self, group: int, handle: int, offset: int) -> None:
        """The sender has written the frames of bulk group ``group``, back to
        back, at ``(handle, offset)`` of memory the receiver shares: one PLACED
        unit replaces their fragments. Only a group none of whose units has
        been taken may be placed."""
        if not 0 <= group < len(self._bulk):
            raise ValueError(f"no bulk group {group} (the parcel has {len(self._bulk)})")
        placed = self._placed
        if (
            group < self._group
            or (group == self._group and (self._frame or self._offset))
            or (placed is not None and placed[group] is not None)
        ):
            raise ValueError(f"only a bulk group whose units are all unsent can be placed, not {group}")
        members = self._bulk[group]
        nbytes = sum(view.nbytes for _, view in members)
        header = HEADER.pack(MAGIC, VERSION, _PLACED, 0, self.vc, self.seq, members[0][0])
        if placed is None:
            placed = self._placed = [None] * len(self._bulk)
        placed[group] = header + PLACED_EXT.pack(handle, offset, nbytes)

    @property
    def done(self) -> bool:
        """Whether every unit has been taken."""
        return self._head is None and self._group == len(self._bulk)

    def next_unit(self) -> list[Buffer]:
        """The buffers of the next unit to send (never empty unless done)."""
        if self._head is not None:
            head, self._head = self._head, None
            return head
        group = self._group
        if self._placed is not None:
            placed = self._placed[group]
            if placed is not None:
                self._group += 1
                return [placed]
        members = self._bulk[group]
        index, view = members[self._frame]
        start = self._offset
        stop = min(start + self._fragment, view.nbytes)
        if stop == view.nbytes:
            self._offset = 0
            self._frame += 1
            if self._frame == len(members):
                self._frame = 0
                self._group += 1
        else:
            self._offset = stop
        ext = FRAGMENT_EXT.pack(start, stop - start)
        header = HEADER.pack(MAGIC, VERSION, _FRAGMENT, 0, self.vc, self.seq, index)
        return [header + ext, view[start:stop]]


def encode_parcel(
    vc: int, seq: int, frames: Sequence[Buffer], eager_threshold: int, fragment_size: int
) -> bytes:
    """The whole parcel as one bytes object (for tests and small messages)."""
    parcel = OutgoingParcel(vc, seq, frames, eager_threshold, fragment_size)
    out = bytearray()
    while not parcel.done:
        for buf in parcel.next_unit():
            out += buf
    return bytes(out)


class _Assembly:
    """A parcel whose bulk groups are still arriving."""

    __slots__ = ("seq", "sizes", "frames", "groups", "group", "members", "member", "frame", "offset")

    def __init__(
        self,
        seq: int,
        sizes: list[int],
        frames: list[memoryview],
        groups: list[tuple[list[int], int]],
    ) -> None:
        self.seq = seq
        #: Frame sizes, without flags.
        self.sizes = sizes
        self.frames = frames
        #: The bulk groups: the indices of their frames, and their total size.
        self.groups = groups
        #: The bulk group due, its frames, which of them is due (and its index),
        #: and how much of that frame has arrived.
        self.group = 0
        self.members = groups[0][0]
        self.member = 0
        self.frame = self.members[0]
        self.offset = 0


class ParcelDecoder:
    """Incremental decoder: bytes in, events out, bulk data written in place.

    Use it like :class:`asyncio.BufferedProtocol`: receive into
    :meth:`get_buffer`, then report the count to :meth:`buffer_updated`.
    While a fragment's payload is due, :meth:`get_buffer` returns the very
    slice of the destination buffer it belongs in, so bulk bytes are written
    once, by the kernel, where the deserializer will find them.

    With ``require_connect`` (the accepting side of a connection) a parcel is
    only valid on a virtual connection the peer opened with CONNECT.

    Each group of frames (see the module's docstring) gets a buffer of its
    own: an eager group a copy out of the receive buffer (a ``bytearray``), a
    bulk group one allocated when its first fragment arrives (a numpy array of
    bytes, like Dask's ``host_array``). A bulk group that arrives PLACED costs
    no allocation: ``placement`` resolves its location to memory shared with
    the sender, once per group (without it, a PLACED record is a protocol
    error). An empty frame is an empty view of no group's buffer.

    After a :class:`ProtocolError` the decoder is unusable: the stream has
    lost its framing and the connection must be closed.
    """

    def __init__(
        self,
        limits: Limits = Limits(),
        buffer_size: int = 256 * 1024,
        require_connect: bool = False,
        placement: Placement | None = None,
    ) -> None:
        self.limits = limits
        self.require_connect = require_connect
        self.placement = placement
        self._size = buffer_size
        self._pool = packet_pool(buffer_size)
        # Held only while bytes in it wait to be parsed (see packet_pool).
        self._buf: bytearray | None = None
        self._view = _NOTHING
        self._start = 0
        self._end = 0
        self._need = HEADER.size
        self._direct: memoryview | None = None
        self._direct_pos = 0
        self._direct_vc = 0
        self._seq: dict[int, int] = {}
        self._assembly: dict[int, _Assembly] = {}

    @property
    def idle(self) -> bool:
        """Whether the stream is between messages (a clean place to end)."""
        return (
            self._direct is None
            and self._start == self._end
            and not self._assembly
        )

    def get_buffer(self) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._buf is None:
            self._start = self._end = 0
            self._buf = self._pool.take()
            self._view = memoryview(self._buf)
        capacity = len(self._buf)
        if capacity - self._end < max(4096, self._need - (self._end - self._start)):
            pending = self._end - self._start
            if self._need > capacity:
                grown = bytearray(self._need)
                grown[:pending] = self._view[self._start : self._end]
                self._view.release()
                self._buf = grown
                self._view = memoryview(grown)
            else:
                self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        view = self._view[self._end :]
        if self._assembly:
            # Bulk data is due: read no further than the next fragment header,
            # so that payloads land in their frames rather than in this buffer.
            want = max(self._need, HEADER.size + FRAGMENT_EXT.size) - (self._end - self._start)
            if want > 0:
                return view[:want]
        return view

    def buffer_updated(self, nbytes: int) -> list[Event]:
        events: list[Event] = []
        if self._direct is not None:
            self._direct_pos += nbytes
            if self._direct_pos == self._direct.nbytes:
                self._direct = None
                self._fragment_done(self._direct_vc, events)
                self._parse(events)
        else:
            self._end += nbytes
            self._parse(events)
        if self._start == self._end and self._buf is not None:
            # All parsed (frames are copies): the buffer goes back to the pool.
            self._view.release()
            self._pool.give(self._buf)
            self._buf, self._view = None, _NOTHING
        return events

    def feed(self, data: Buffer) -> list[Event]:
        """Decode ``data`` (any length); a convenience over get_buffer."""
        src = memoryview(data).cast("B")
        events: list[Event] = []
        while src.nbytes:
            dst = self.get_buffer()
            n = min(dst.nbytes, src.nbytes)
            dst[:n] = src[:n]
            src = src[n:]
            events.extend(self.buffer_updated(n))
        return events

    def check_eof(self) -> None:
        """Raise if the stream ended in the middle of a message."""
        if not self.idle:
            raise ProtocolError("connection closed in the middle of a parcel")

    def _parse(self, events: list[Event]) -> None:
        view = self._view
        unpack = HEADER.unpack_from
        while self._direct is None:
            start, available = self._start, self._end - self._start
            if available < HEADER.size:
                self._need = HEADER.size
                return
            magic, version, kind, flags, vc, seq, count = unpack(view, start)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic {bytes(magic)!r}")
            if version != VERSION:
                raise ProtocolError(f"unsupported protocol version {version}")
            if flags:
                raise ProtocolError(f"reserved flags set: {flags:#x}")
            if kind == _PARCEL:
                used = self._parcel(vc, seq, count, start, available, events)
            elif kind == _FRAGMENT:
                used = self._fragment(vc, seq, count, start, available, events)
            elif kind == _PLACED:
                used = self._placed(vc, seq, count, start, available, events)
            elif kind == _HELLO:
                if count > MAX_HELLO_BYTES or seq or vc:
                    raise ProtocolError(f"malformed hello of {count} bytes")
                used = HEADER.size + count
                if available >= used:
                    events.append(Hello(bytes(view[start + HEADER.size : start + used])))
            elif kind in (_CONNECT, _CLOSE):
                if count or seq:
                    raise ProtocolError(f"malformed {Kind(kind).name} for vc {vc}")
                used = HEADER.size
                self._control(Kind(kind), vc, events)
            else:
                raise ProtocolError(f"unknown parcel kind {kind}")
            if available < used:
                self._need = used
                return
            self._start += used

    def _control(self, kind: Kind, vc: int, events: list[Event]) -> None:
        if vc in self._assembly:
            raise ProtocolError(f"{kind.name} on vc {vc} while a parcel is incomplete")
        if kind == Kind.CONNECT:
            if vc in self._seq:
                raise ProtocolError(f"CONNECT for open vc {vc}")
            self._seq[vc] = 0
            events.append(Connect(vc))
        else:
            self._seq.pop(vc, None)
            events.append(Close(vc))

    def _parcel(
        self, vc: int, seq: int, nframes: int, start: int, available: int, events: list[Event]
    ) -> int:
        limits = self.limits
        if nframes > limits.max_frames or nframes * 8 > limits.max_eager_bytes:
            raise ProtocolError(f"parcel of {nframes} frames exceeds the limits")
        expected = self._seq.get(vc)
        if expected is None:
            if self.require_connect:
                raise ProtocolError(f"parcel on vc {vc}, which was never opened")
            expected = 0
        if seq != expected or vc in self._assembly:
            raise ProtocolError(f"parcel {seq} on vc {vc} out of order (expected {expected})")
        table_end = HEADER.size + 8 * nframes
        if available < table_end:
            return table_end
        words = _word_table(nframes).unpack_from(self._view, start + HEADER.size)
        sizes = words[::2]
        groups = None
        # Eager groups of non-empty frames under 4 GiB are recognised from the
        # high words alone (0 starts a group, SHARE continues it); ``ends``
        # are where they end.
        ends = None
        if nframes and 0 not in sizes:
            highs = words[1::2]
            if highs == (_ONE_GROUP_HIGH.get(nframes) or tuple(_one_group(nframes)[1::2])):
                ends = [nframes]
            elif not highs[0] and highs.count(0) + highs.count(_SHARE_HIGH) == nframes:
                ends = [index for index, high in enumerate(highs) if not high]
                ends[0] = nframes
                ends.sort()
        if ends is not None:
            eager = total = sum(sizes)
        else:
            table = _size_table(nframes).unpack_from(self._view, start + HEADER.size)
            masked, groups, empties = self._groups(table)
            eager = total = 0
            for flag, nbytes, _ in groups:
                total += nbytes
                if not flag:
                    eager += nbytes
        if 8 * nframes + eager > limits.max_eager_bytes:
            raise ProtocolError(
                f"{8 * nframes} bytes of sizes and {eager} eager bytes exceed the limit"
                f" of {limits.max_eager_bytes}"
            )
        if total > limits.max_message_bytes:
            raise ProtocolError(f"message of {total} bytes exceeds the limit")
        used = table_end + eager
        if available < used:
            return used
        self._seq[vc] = seq + 1
        view = self._view
        position = start + table_end
        if ends is not None:
            frames = []
            if len(ends) == 1:  # one group: the common small message
                block = memoryview(bytearray(view[position : position + eager]))
                position = 0
                for size in sizes:
                    end = position + size
                    frames.append(block[position:end])
                    position = end
                events.append(Message(vc, seq, frames))
                return used
            first = 0
            for stop in ends:
                if stop - first == 1:  # a frame of its own
                    end = position + sizes[first]
                    frames.append(memoryview(bytearray(view[position:end])))
                    position = end
                    first = stop
                    continue
                chunk = sizes[first:stop]
                end = position + sum(chunk)
                block = memoryview(bytearray(view[position:end]))
                position = end
                offset = 0
                for size in chunk:
                    end = offset + size
                    frames.append(block[offset:end])
                    offset = end
                first = stop
            events.append(Message(vc, seq, frames))
            return used
        assert groups is not None
        # Bulk frames stay _NOTHING until their group's buffer is known.
        frames = [_NOTHING] * nframes
        bulk = []
        for flag, nbytes, members in groups:
            if flag:
                bulk.append((members, nbytes))
                continue
            block = memoryview(bytearray(view[position : position + nbytes]))
            position += nbytes
            if len(members) == 1:
                frames[members[0]] = block
                continue
            offset = 0
            for index in members:
                end = offset + masked[index]
                frames[index] = block[offset:end]
                offset = end
        for index in empties:
            frames[index] = _NOTHING[:0]
        if bulk:
            self._assembly[vc] = _Assembly(seq, masked, frames, bulk)
        else:
            events.append(Message(vc, seq, frames))
        return used

    @staticmethod
    def _groups(table: Sequence[int]) -> tuple[list[int], list[tuple[int, int, list[int]]], list[int]]:
        """Check a size table. Returns the sizes without flags, the groups as
        ``(BULK or 0, total size, indices of their frames)``, and the indices
        of the empty frames."""
        sizes: list[int] = []
        groups: list[tuple[int, int, list[int]]] = []
        empties: list[int] = []
        members: list[int] | None = None
        flag = nbytes = 0
        for index, size in enumerate(table):
            n = size & SIZE_MASK
            sizes.append(n)
            if not n:
                if size:
                    kind = "bulk" if size & BULK else "shared"
                    raise ProtocolError(f"empty {kind} frame {index}")
                empties.append(index)
            elif size & SHARE:
                if members is None:
                    raise ProtocolError(f"frame {index} shares the buffer of no earlier frame")
                if size & BULK != flag:
                    raise ProtocolError(f"frame {index} shares a buffer across eager and bulk frames")
                members.append(index)
                nbytes += n
            else:
                if members is not None:
                    groups.append((flag, nbytes, members))
                members = [index]
                flag = size & BULK
                nbytes = n
        if members is not None:
            groups.append((flag, nbytes, members))
        return sizes, groups, empties

    def _allocate(self, assembly: _Assembly) -> None:
        """Give the bulk group now due its buffer."""
        members, nbytes = assembly.groups[assembly.group]
        buffer = np.empty(nbytes, dtype=np.uint8).data
        sizes, frames = assembly.sizes, assembly.frames
        offset = 0
        for index in members:
            end = offset + sizes[index]
            frames[index] = buffer[offset:end]
            offset = end

    def _fragment(
        self, vc: int, seq: int, index: int, start: int, available: int, events: list[Event]
    ) -> int:
        used = HEADER.size + FRAGMENT_EXT.size
        if available < used:
            return used
        offset, nbytes = FRAGMENT_EXT.unpack_from(self._view, start + HEADER.size)
        assembly = self._assembly.get(vc)
        if assembly is None or assembly.seq != seq:
            raise ProtocolError(f"fragment for unknown parcel {seq} on vc {vc}")
        expected = assembly.frame
        if (
            index != expected
            or offset != assembly.offset
            or not 0 < nbytes <= assembly.sizes[expected] - offset
        ):
            raise ProtocolError(
                f"fragment {index}@{offset}+{nbytes} does not continue parcel {seq} on vc {vc}"
            )
        if not offset and not assembly.member:
            self._allocate(assembly)
        target = assembly.frames[expected]
        here = min(nbytes, available - used)
        target[offset : offset + here] = self._view[start + used : start + used + here]
        assembly.offset += nbytes
        if here < nbytes:
            self._direct = target[offset : offset + nbytes]
            self._direct_pos = here
            self._direct_vc = vc
        else:
            self._fragment_done(vc, events)
        return used + here

    def _placed(
        self, vc: int, seq: int, index: int, start: int, available: int, events: list[Event]
    ) -> int:
        used = HEADER.size + PLACED_EXT.size
        if available < used:
            return used
        handle, offset, nbytes = PLACED_EXT.unpack_from(self._view, start + HEADER.size)
        assembly = self._assembly.get(vc)
        if assembly is None or assembly.seq != seq:
            raise ProtocolError(f"placed group for unknown parcel {seq} on vc {vc}")
        if self.placement is None:
            raise ProtocolError("placed group on a connection without shared memory")
        members, total = assembly.groups[assembly.group]
        if index != members[0] or assembly.member or assembly.offset or nbytes != total:
            raise ProtocolError(
                f"placed group {index}+{nbytes} is not the next bulk group of parcel {seq} on vc {vc}"
            )
        view = self.placement(handle, offset, nbytes)
        sizes, frames = assembly.sizes, assembly.frames
        position = 0
        for frame in members:
            end = position + sizes[frame]
            frames[frame] = view[position:end]
            position = end
        self._next_group(vc, assembly, events)
        return used

    def _fragment_done(self, vc: int, events: list[Event]) -> None:
        assembly = self._assembly[vc]
        if assembly.offset < assembly.sizes[assembly.frame]:
            return
        assembly.member += 1
        if assembly.member < len(assembly.members):
            assembly.frame = assembly.members[assembly.member]
            assembly.offset = 0
        else:
            self._next_group(vc, assembly, events)

    def _next_group(self, vc: int, assembly: _Assembly, events: list[Event]) -> None:
        assembly.group += 1
        if assembly.group < len(assembly.groups):
            assembly.members = assembly.groups[assembly.group][0]
            assembly.member = 0
            assembly.frame = assembly.members[0]
            assembly.offset = 0
        else:
            del self._assembly[vc]
            events.append(Message(vc, assembly.seq, assembly.frames))
