"""The lci:// wire format: parcels to bytes, and bytes back to parcels.

Sans-I/O: nothing here touches a socket, a thread or an event loop, so the
whole protocol can be tested on its own with plain bytes.

Every network message starts with the same 24-byte header (little-endian)::

    magic "LCIP" | version u8 | kind u8 | flags u16 | vc u32 | seq u64 | count u32

``vc`` names the virtual connection (one Dask comm) the message belongs to and
``seq`` numbers the parcels of one direction of it. What ``count`` means, and
what follows the header, depends on the kind:

``HELLO``     count = payload length; the payload (opaque, bounded) follows.
``CONNECT``   opens virtual connection ``vc``; count = 0, no body.
``CLOSE``     closes virtual connection ``vc``; count = 0, no body.
``PARCEL``    one Dask message. count = number of frames, then one u64 per
              frame: its size, with the top bit set when the frame is *bulk*.
              The eager (non-bulk) frames follow, piggybacked in order.
``FRAGMENT``  a piece of a bulk frame. count = frame index, then
              ``offset u64 | nbytes u64`` and ``nbytes`` of data, which the
              receiver writes straight into the frame's buffer (the one-sided
              put of LCI, emulated over a byte stream).
``PLACED``    all bulk frames of a parcel, already written by the sender into
              memory the receiver shares with it (a true one-sided put).
              count = index of the first bulk frame, then
              ``handle u64 | offset u64 | nbytes u64``: where the frames lie,
              back to back, in the receiver's terms (see ``placement`` of
              :class:`ParcelDecoder`).

The bulk frames of a parcel follow it in order before the next parcel of the
same virtual connection; fragments of different virtual connections may
interleave, which is what keeps small messages flowing past a large one.
Every length read off the wire is checked against :class:`Limits` before
anything is allocated from it.
"""

from __future__ import annotations

import struct
from pickle import PickleBuffer
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MAGIC = b"LCIP"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQI")
FRAGMENT_EXT = struct.Struct("<QQ")
PLACED_EXT = struct.Struct("<QQQ")
BULK = 1 << 63
MAX_HELLO_BYTES = 64 * 1024
MAX_VC = (1 << 32) - 1

Buffer = bytes | bytearray | memoryview
#: Where the receiver finds placed frames: ``(handle, offset, nbytes)`` to a
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


def _size_table(nframes: int) -> struct.Struct:
    table = _SIZE_TABLES.get(nframes)
    return table if table is not None else struct.Struct(f"<{nframes}Q")


def _parcel_head(nframes: int) -> struct.Struct:
    head = _PARCEL_HEADS.get(nframes)
    return head if head is not None else struct.Struct(f"{HEADER.format}{nframes}Q")


class ProtocolError(ValueError):
    """The peer sent something that is not a valid parcel stream."""


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


class OutgoingParcel:
    """One message being sent, cut into units that go out whole.

    The first unit is the parcel itself (header, sizes and eager frames); then
    one unit per fragment of each bulk frame. A sender interleaves the units of
    different virtual connections but sends those of one parcel in order.

    A frame is eager when it is at most ``eager_threshold`` bytes and the
    parcel's inline part (size table and eager frames) stays within
    ``eager_budget``, the receiver's ``max_eager_bytes``; the rest go bulk.
    """

    __slots__ = ("vc", "seq", "nbytes", "_bulk", "_fragment", "_head", "_frame", "_offset", "_placed")

    def __init__(
        self,
        vc: int,
        seq: int,
        frames: Sequence[Buffer],
        eager_threshold: int,
        fragment_size: int,
        eager_budget: int = Limits.max_eager_bytes,
    ) -> None:
        if fragment_size < 1:
            raise ValueError(f"fragment_size must be positive, got {fragment_size}")
        sizes = []
        eager: list[memoryview] = []
        bulk: list[tuple[int, memoryview]] = []
        budget = eager_budget - 8 * len(frames)
        nbytes = 0
        for index, frame in enumerate(frames):
            view = _as_bytes_view(frame)
            n = view.nbytes
            nbytes += n
            if n and (n > eager_threshold or n > budget):
                sizes.append(n | BULK)
                bulk.append((index, view))
            else:
                sizes.append(n)
                budget -= n
                if n:
                    eager.append(view)
        head = _parcel_head(len(sizes)).pack(MAGIC, VERSION, _PARCEL, 0, vc, seq, len(sizes), *sizes)
        self.vc = vc
        self.seq = seq
        self.nbytes = nbytes
        self._head: list[Buffer] | None = [head, *eager]
        self._bulk = bulk
        self._fragment = fragment_size
        self._frame = 0
        self._offset = 0
        self._placed: bytes | None = None

    @property
    def bulk(self) -> list[memoryview]:
        """The bulk frames, in order."""
        return [view for _, view in self._bulk]

    def place(self, handle: int, offset: int) -> None:
        """The sender has written every bulk frame, back to back, at
        ``(handle, offset)`` of memory the receiver shares: one PLACED unit
        replaces their fragments."""
        if not self._bulk or self._frame or self._offset or self._placed is not None:
            raise ValueError("only a parcel whose bulk frames are all unsent can be placed")
        nbytes = sum(view.nbytes for _, view in self._bulk)
        header = HEADER.pack(MAGIC, VERSION, _PLACED, 0, self.vc, self.seq, self._bulk[0][0])
        self._placed = header + PLACED_EXT.pack(handle, offset, nbytes)

    @property
    def done(self) -> bool:
        """Whether every unit has been taken."""
        return self._head is None and self._frame == len(self._bulk)

    def next_unit(self) -> list[Buffer]:
        """The buffers of the next unit to send (never empty unless done)."""
        if self._head is not None:
            head, self._head = self._head, None
            return head
        if self._placed is not None:
            self._frame = len(self._bulk)
            return [self._placed]
        index, view = self._bulk[self._frame]
        start = self._offset
        stop = min(start + self._fragment, view.nbytes)
        if stop == view.nbytes:
            self._frame += 1
            self._offset = 0
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
    """A parcel whose bulk frames are still arriving."""

    __slots__ = ("seq", "sizes", "frames", "bulk", "position", "offset")

    def __init__(
        self, seq: int, sizes: tuple[int, ...], frames: list[memoryview], bulk: list[int]
    ) -> None:
        self.seq = seq
        self.sizes = sizes
        self.frames = frames
        self.bulk = bulk
        self.position = 0
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

    A bulk frame that follows a bulk frame of exactly ``shard_bytes`` shares
    its buffer: Dask splits one large object into consecutive pieces of that
    size, and pieces that are adjacent in one buffer it joins without a copy.
    Buffers are allocated when the first fragment of their frame arrives, so
    frames that arrive PLACED cost no allocation: ``placement`` resolves
    their location to memory shared with the sender (without it, a PLACED
    record is a protocol error).

    After a :class:`ProtocolError` the decoder is unusable: the stream has
    lost its framing and the connection must be closed.
    """

    def __init__(
        self,
        limits: Limits = Limits(),
        buffer_size: int = 256 * 1024,
        require_connect: bool = False,
        shard_bytes: int | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.limits = limits
        self.require_connect = require_connect
        self.shard_bytes = shard_bytes
        self.placement = placement
        self._size = buffer_size
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
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
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self._size and self._need <= self._size:
                self._buf = bytearray(self._size)
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
            return events
        self._end += nbytes
        self._parse(events)
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
            elif kind == _CONNECT or kind == _CLOSE:
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
        sizes = _size_table(nframes).unpack_from(self._view, start + HEADER.size)
        if nframes and max(sizes) >= BULK:
            eager = 0
            total = 0
            for size in sizes:
                if size & BULK:
                    size &= ~BULK
                    if not size:
                        raise ProtocolError("empty bulk frame")
                else:
                    eager += size
                total += size
        else:
            eager = total = sum(sizes)
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
        block = memoryview(bytearray(self._view[start + table_end : start + used]))
        frames: list[memoryview] = []
        bulk: list[int] = []
        position = 0
        for index, size in enumerate(sizes):
            if size >= BULK:
                frames.append(block[:0])
                bulk.append(index)
            else:
                frames.append(block[position : position + size])
                position += size
        self._seq[vc] = seq + 1
        if bulk:
            self._assembly[vc] = _Assembly(seq, sizes, frames, bulk)
        else:
            events.append(Message(vc, seq, frames))
        return used

    def _allocate_run(self, assembly: _Assembly) -> None:
        """Give the bulk frame now due its buffer, shared with the shard-sized
        pieces that directly follow it."""
        sizes, bulk, frames = assembly.sizes, assembly.bulk, assembly.frames
        run = [bulk[assembly.position]]
        for index in bulk[assembly.position + 1 :]:
            if index != run[-1] + 1 or sizes[run[-1]] & ~BULK != self.shard_bytes:
                break
            run.append(index)
        buffer = memoryview(np.empty(sum(sizes[i] & ~BULK for i in run), dtype=np.uint8))
        offset = 0
        for index in run:
            size = sizes[index] & ~BULK
            frames[index] = buffer[offset : offset + size]
            offset += size

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
        expected = assembly.bulk[assembly.position]
        target = assembly.frames[expected]
        if not target.nbytes:
            self._allocate_run(assembly)
            target = assembly.frames[expected]
        if index != expected or offset != assembly.offset or not 0 < nbytes <= target.nbytes - offset:
            raise ProtocolError(
                f"fragment {index}@{offset}+{nbytes} does not continue parcel {seq} on vc {vc}"
            )
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
            raise ProtocolError(f"placed frames for unknown parcel {seq} on vc {vc}")
        if self.placement is None:
            raise ProtocolError("placed frames on a connection without shared memory")
        sizes = [assembly.sizes[i] & ~BULK for i in assembly.bulk]
        if assembly.position or assembly.offset or index != assembly.bulk[0] or nbytes != sum(sizes):
            raise ProtocolError(
                f"placed frames {index}+{nbytes} do not cover the bulk of parcel {seq} on vc {vc}"
            )
        view = self.placement(handle, offset, nbytes)
        position = 0
        for frame, size in zip(assembly.bulk, sizes, strict=True):
            assembly.frames[frame] = view[position : position + size]
            position += size
        del self._assembly[vc]
        events.append(Message(vc, assembly.seq, assembly.frames))
        return used

    def _fragment_done(self, vc: int, events: list[Event]) -> None:
        assembly = self._assembly[vc]
        if assembly.offset == assembly.frames[assembly.bulk[assembly.position]].nbytes:
            assembly.position += 1
            assembly.offset = 0
            if assembly.position == len(assembly.bulk):
                del self._assembly[vc]
                events.append(Message(vc, assembly.seq, assembly.frames))
