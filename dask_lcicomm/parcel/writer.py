"""The writer: a Dask message cut into the units of one parcel (the format is
:mod:`.wire`'s, the grouping of its frames :mod:`.grouping`'s).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from dask_lcicomm.parcel.grouping import as_memoryview, plan
from dask_lcicomm.parcel.wire import (
    BULK,
    FRAGMENT,
    FRAGMENT_EXT,
    HEADER,
    MAGIC,
    PARCEL,
    PLACED,
    PLACED_EXT,
    SHARE,
    VERSION,
    Buffer,
    Limits,
    MessageTooLarge,
    one_group,
)

#: Compiled parcel headers followed by a size table, for the frame counts most
#: messages have; and the same with the table as pairs of u32 (low word, high
#: word), which write one eager group without a loop (see :func:`one_group`).
_PARCEL_HEADS = {n: struct.Struct(f"{HEADER.format}{n}Q") for n in range(33)}
_WORD_HEADS = {n: struct.Struct(f"{HEADER.format}{2 * n}I") for n in range(33)}

#: A parcel whose frames total at most this many bytes is sent as one buffer,
#: its frames copied behind the head: below this size the copy costs less than
#: a buffer per frame in every layer below (send queue, ring or ``sendmsg``).
JOIN_BYTES = 32 * 1024


def _parcel_head(nframes: int) -> struct.Struct:
    head = _PARCEL_HEADS.get(nframes)
    return head if head is not None else struct.Struct(f"{HEADER.format}{nframes}Q")


def _word_head(nframes: int) -> struct.Struct:
    head = _WORD_HEADS.get(nframes)
    return head if head is not None else struct.Struct(f"{HEADER.format}{2 * nframes}I")


_ONE_GROUP = {n: one_group(n) for n in range(1, 33)}
_OR_SHARE = SHARE.__or__
_ONE_FRAME_HEAD = _PARCEL_HEADS[1]


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
        views, sizes, starts = plan(frames, eager_threshold)
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
                head = _ONE_FRAME_HEAD.pack(MAGIC, VERSION, PARCEL, 0, vc, seq, 1, nbytes)
            else:
                words = (_ONE_GROUP.get(nframes) or one_group(nframes)).copy()
                words[::2] = sizes
                if len(starts) > 1:
                    for index in starts[1:]:
                        words[2 * index + 1] = 0
                packer = _WORD_HEADS.get(nframes) or _word_head(nframes)
                head = packer.pack(MAGIC, VERSION, PARCEL, 0, vc, seq, nframes, *words)
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
                        bulk.append([(first, as_memoryview(views[first]))])
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
                bulk.append([(i, as_memoryview(views[i])) for i in members])
            head = _parcel_head(nframes).pack(MAGIC, VERSION, PARCEL, 0, vc, seq, nframes, *sizes)
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
    def has_bulk(self) -> bool:
        """Whether any frame group goes bulk (the parcel is more than its head)."""
        return bool(self._bulk)

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
        header = HEADER.pack(MAGIC, VERSION, PLACED, 0, self.vc, self.seq, members[0][0])
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
        header = HEADER.pack(MAGIC, VERSION, FRAGMENT, 0, self.vc, self.seq, index)
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
