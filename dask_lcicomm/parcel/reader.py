"""The reader: bytes in, events out, each group of frames in a buffer of its
own (the format is :mod:`.wire`'s).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from dask_lcicomm.packet_pool import packet_pool
from dask_lcicomm.parcel.wire import (
    FRAGMENT,
    FRAGMENT_EXT,
    HEADER,
    MAGIC,
    MAX_HELLO_BYTES,
    PARCEL,
    PLACED,
    PLACED_EXT,
    SHARE,
    VERSION,
    Buffer,
    Close,
    Connect,
    Event,
    Hello,
    Kind,
    Limits,
    Message,
    Placement,
    ProtocolError,
    groups_of,
    one_group,
)

_HELLO, _CONNECT, _CLOSE = int(Kind.HELLO), int(Kind.CONNECT), int(Kind.CLOSE)

#: Compiled size tables, for the frame counts most messages have; and the same
#: as pairs of u32 (low word, high word), which recognise one eager group
#: without a loop (see :func:`one_group`).
_SIZE_TABLES = {n: struct.Struct(f"<{n}Q") for n in range(33)}
_WORD_TABLES = {n: struct.Struct(f"<{2 * n}I") for n in range(33)}

#: Empty frames are slices of this (each its own view: releasing one harms no other).
_NOTHING = memoryview(bytearray())


#: A parcel's size table read: sizes, ``ends`` or groups, empty frames, eager bytes.
_Table = tuple[Sequence[int], "list[int] | None", "list[tuple[int, int, list[int]]] | None",
               list[int], int]


def _size_table(nframes: int) -> struct.Struct:
    table = _SIZE_TABLES.get(nframes)
    return table if table is not None else struct.Struct(f"<{nframes}Q")


def _word_table(nframes: int) -> struct.Struct:
    table = _WORD_TABLES.get(nframes)
    return table if table is not None else struct.Struct(f"<{2 * nframes}I")


_ONE_GROUP_HIGH = {n: tuple(one_group(n)[1::2]) for n in range(1, 33)}
_SHARE_HIGH = SHARE >> 32


class _Assembly:
    """A parcel whose bulk groups are still arriving."""

    __slots__ = ("seq", "sizes", "frames", "groups", "group", "members", "member", "frame", "offset")

    def __init__(
        self,
        seq: int,
        sizes: Sequence[int],
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

    Each group of frames (see :mod:`.wire`) gets a buffer of its
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
        #: The size table of a parcel whose eager bytes are still arriving.
        self._waiting: _Table | None = None

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
        self._give_back_if_parsed()
        return events

    def read_nothing(self) -> None:
        """The read into :meth:`get_buffer`'s view found no bytes (it would
        block): a quiet peer must not keep a buffer."""
        self._give_back_if_parsed()

    def _give_back_if_parsed(self) -> None:
        if self._start == self._end and self._buf is not None:
            # All parsed (frames are copies): the buffer goes back to the pool.
            self._view.release()
            self._pool.give(self._buf)
            self._buf, self._view = None, _NOTHING

    def feed(self, data: Buffer) -> list[Event]:
        """Decode ``data`` (any length). With no bytes waiting before it,
        it is parsed where it lies (frames are copies) and only what is left
        of it, a parcel's beginning, is kept; else it joins them."""
        src = memoryview(data).cast("B")
        events: list[Event] = []
        if self._buf is None and self._direct is None and src.nbytes:
            self._view, self._start, self._end = src, 0, src.nbytes
            try:
                self._parse(events)
                src = src[self._start :]
            finally:
                self._view, self._start, self._end = _NOTHING, 0, 0
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
            if kind == PARCEL:
                used = self._parcel(vc, seq, count, start, available, events)
            elif kind == FRAGMENT:
                used = self._fragment(vc, seq, count, start, available, events)
            elif kind == PLACED:
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
        # The size table is read once, when it is complete, not again on every
        # read of its eager bytes: a parcel of many frames would cost that many
        # table reads times the frames.
        table = self._waiting or self._size_table(nframes, start)
        sizes, ends, groups, empties, eager = table
        used = table_end + eager
        if available < used:
            self._waiting = table
            return used
        self._waiting = None
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
                end = offset + sizes[index]
                frames[index] = block[offset:end]
                offset = end
        for index in empties:
            frames[index] = _NOTHING[:0]
        if bulk:
            self._assembly[vc] = _Assembly(seq, sizes, frames, bulk)
        else:
            events.append(Message(vc, seq, frames))
        return used

    def _size_table(self, nframes: int, start: int) -> _Table:
        """Read and check the size table of the parcel at ``start``: the sizes,
        where its eager groups end when the high words alone tell them
        (``ends``), else its ``groups`` and empty frames, and its eager bytes."""
        limits = self.limits
        words = _word_table(nframes).unpack_from(self._view, start + HEADER.size)
        sizes: Sequence[int] = words[::2]
        groups = None
        empties: list[int] = []
        # Eager groups of non-empty frames under 4 GiB are recognised from the
        # high words alone (0 starts a group, SHARE continues it); ``ends``
        # are where they end.
        ends = None
        if nframes and 0 not in sizes:
            highs = words[1::2]
            if highs == (_ONE_GROUP_HIGH.get(nframes) or tuple(one_group(nframes)[1::2])):
                ends = [nframes]
            elif not highs[0] and highs.count(0) + highs.count(_SHARE_HIGH) == nframes:
                ends = [index for index, high in enumerate(highs) if not high]
                ends[0] = nframes
                ends.sort()
        if ends is not None:
            eager = total = sum(sizes)
        else:
            table = _size_table(nframes).unpack_from(self._view, start + HEADER.size)
            sizes, groups, empties = groups_of(table)
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
        return sizes, ends, groups, empties, eager

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
