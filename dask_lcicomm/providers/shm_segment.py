"""Shared-memory segments: anonymous, sealed, and gone with their last user.

Each direction of a shared-memory device is one segment, created by its
*receiver* and granted to the sender over a Unix socket (``SCM_RIGHTS``).
Segments are ``memfd_create`` files: they have no name in any file system,
so a process killed at any moment leaves nothing behind in ``/dev/shm``; the
kernel frees the memory when the last mapping and descriptor are gone. A
mapped segment is a :class:`Region` that keeps no descriptor (an ``mmap``
object would keep one per mapping), so once granted a segment costs no
descriptor on either side.

They are sealed against shrinking and growing before they are shared: a
peer that could truncate a segment under our mapping could kill us with
``SIGBUS``. The segment a peer hands us is checked for those seals and for
the exact size its layout announces before we map it.

Layout of a segment (offsets in bytes; control words 64 bytes apart so that
the two sides do not write to the same cache line)::

    0       TAIL     bytes the sender has published into the ring
    64      HEAD     bytes the receiver has consumed from the ring
    128     ASLEEP   1 while the receiver waits for a doorbell
    192     WAITING  1 while the sender waits for ring space
    4096    FLAGS    one word per pool block: 1 once the receiver freed it
    ...     RING     the parcel byte stream (page aligned)
    ...     POOL     blocks the sender writes large frames into (page aligned)
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import Any

from dask_lcicomm.providers._atomics import Region, map_shared

TAIL = 0
HEAD = 64
ASLEEP = 128
WAITING = 192
FLAGS = 4096
PAGE = mmap.PAGESIZE

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def round_up(n: int, to: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``to`` (whole pages by default)."""
    return -(-n // to) * to


class SegmentError(ConnectionError):
    """A peer's segment or its description cannot be used."""


@dataclass(frozen=True)
class Layout:
    """Sizes of a segment's ring and pool, and where everything lies."""

    ring_bytes: int
    pool_bytes: int
    blocks: int

    #: What a peer may ask us to map (a layout from the wire is checked first).
    MAX_RING_BYTES = 1 << 30
    MAX_POOL_BYTES = 64 << 30
    MAX_BLOCKS = 1 << 16

    def __post_init__(self) -> None:
        if not (PAGE <= self.ring_bytes <= self.MAX_RING_BYTES and self.ring_bytes % PAGE == 0):
            raise SegmentError(f"ring of {self.ring_bytes} bytes is not a multiple of the page size"
                               f" between {PAGE} and {self.MAX_RING_BYTES}")
        if not (0 <= self.pool_bytes <= self.MAX_POOL_BYTES and self.pool_bytes % PAGE == 0):
            raise SegmentError(f"pool of {self.pool_bytes} bytes is not a multiple of the page size"
                               f" up to {self.MAX_POOL_BYTES}")
        if not 1 <= self.blocks <= self.MAX_BLOCKS:
            raise SegmentError(f"{self.blocks} pool blocks is not between 1 and {self.MAX_BLOCKS}")

    @property
    def ring_offset(self) -> int:
        return round_up(FLAGS + 8 * self.blocks)

    @property
    def pool_offset(self) -> int:
        return self.ring_offset + self.ring_bytes

    @property
    def nbytes(self) -> int:
        return self.pool_offset + self.pool_bytes

    def flag(self, block: int) -> int:
        """Offset of the word that says whether ``block`` came back."""
        return FLAGS + 8 * block

    def describe(self) -> dict[str, int]:
        return {"ring": self.ring_bytes, "pool": self.pool_bytes, "blocks": self.blocks}

    @classmethod
    def from_description(cls, info: Any) -> Layout:
        """The layout a peer announced, validated."""
        try:
            values = [info[key] for key in ("ring", "pool", "blocks")]
        except (TypeError, KeyError) as e:
            raise SegmentError(f"malformed segment description: {e!r}") from e
        if not all(type(v) is int for v in values):
            raise SegmentError("malformed segment description: sizes must be integers")
        return cls(*values)


def create(layout: Layout) -> tuple[int, Region]:
    """A new sealed segment: its descriptor (to grant) and our mapping."""
    fd = os.memfd_create("dask-lcicomm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, layout.nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        region = map_shared(fd, layout.nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, region


def attach(fd: int, layout: Layout) -> Region:
    """Map a segment a peer granted, after checking that it cannot change size."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise SegmentError(f"granted descriptor is not a sealable memory file: {e}") from e
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise SegmentError("granted segment is not sealed against resizing")
    size = os.fstat(fd).st_size
    if size != layout.nbytes:
        raise SegmentError(f"granted segment has {size} bytes, its layout says {layout.nbytes}")
    return map_shared(fd, size)
