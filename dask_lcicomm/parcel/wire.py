"""The lci:// wire format: its constants, the header, the control units, and
the events a decoder yields.

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
              ``placement`` of :class:`.reader.ParcelDecoder`); ``nbytes``
              is the group's total size.

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
header's buffer, see :func:`.grouping.shares_buffer`). A group is all eager
or all bulk.

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

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

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


#: The kinds the writer and the reader both handle, as plain ints.
PARCEL, FRAGMENT, PLACED = int(Kind.PARCEL), int(Kind.FRAGMENT), int(Kind.PLACED)


def one_group(nframes: int) -> list[int]:
    """The size table of one eager group of ``nframes`` frames under 4 GiB, as
    u32 words, with the sizes (the low words) left 0.

    Its high words are constant (SHARE on every frame but the first), so the
    common small message is written and recognised without a loop over its
    frames."""
    return [0, 0, *(0, SHARE >> 32) * (nframes - 1)]


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


def groups_of(table: Sequence[int]) -> tuple[list[int], list[tuple[int, int, list[int]]], list[int]]:
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
