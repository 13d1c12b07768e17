"""Large bulk groups read in place by the receiver (LCI's rendezvous, by
one-sided reads): where a message fabric has RMA, a sender registers the
group's buffers and announces them; the receiver checks the sizes against
its limits, allocates, reads every buffer, and says it has read them; only
then does the sender let go of the memory and send the parcel that names
the group. A real NIC moves the data without the sender's CPU or a copy.

Two control messages carry it (see :mod:`.message_tags`):

* READABLE: ``| bulk number: u32 | buffers: u32 |`` and per buffer
  ``| address: u64 | key: u64 | length: u64 |``;
* READ: ``| bulk number: u32 |``.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_verbs import Request, Rma

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_BUFFER = struct.Struct("<QQQ")
_NUMBER = struct.Struct("<I")
#: The most buffers one announcement may name.
MAX_BUFFERS = 1024
#: The longest announcement.
MAX_ANNOUNCEMENT = _HEAD.size + MAX_BUFFERS * _BUFFER.size
#: The length of a READ.
READ_BYTES = _NUMBER.size


class Loans:
    """A sender's groups lent to its peer for reading, by bulk number (none
    over a fabric without RMA)."""

    def __init__(self, rma: Rma | None) -> None:
        self._rma = rma
        self._lent: dict[int, tuple[Held, list[Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._lent)

    def lends(self, views: Sequence[memoryview]) -> bool:
        """Whether a group of ``views`` is lent rather than sent."""
        rma = self._rma
        return (rma is not None and len(views) <= MAX_BUFFERS
                and sum(v.nbytes for v in views) >= rma.rendezvous_bytes)

    def lend(self, number: int, views: Sequence[memoryview], held: Held) -> bytes | None:
        """Register ``views`` (one bulk group of ``held``'s parcel) if they
        are to be lent; the READABLE that announces them, or None: send them."""
        if not self.lends(views):
            return None
        assert self._rma is not None
        handles = []
        announcement = [_HEAD.pack(number, len(views))]
        try:
            for view in views:
                handle, address, key = self._rma.register(view)
                handles.append(handle)
                announcement.append(_BUFFER.pack(address, key, view.nbytes))
        except OSError as e:
            logger.warning("sending a bulk group the fabric could not register: %s", e)
            self._unregister(handles)
            return None
        self._lent[number] = (held, handles)
        held.bulk_out += 1
        return b"".join(announcement)

    def returned(self, number: int) -> None:
        """The peer has read group ``number``: the memory is the sender's again."""
        entry = self._lent.pop(number, None)
        if entry is None:
            raise ProtocolError(f"the peer read bulk message {number}, which was not lent")
        held, handles = entry
        self._unregister(handles)
        held.bulk_out -= 1

    def clear(self) -> None:
        """Take every loan back (the device closes)."""
        for _, handles in self._lent.values():
            self._unregister(handles)
        self._lent.clear()

    def _unregister(self, handles: list[Any]) -> None:
        assert self._rma is not None
        for handle in handles:
            self._rma.unregister(handle)


class Reads:
    """The reads of one announced group, as one request."""

    __slots__ = ("_requests",)

    def __init__(self, requests: list[Request]) -> None:
        self._requests = requests

    @property
    def completed(self) -> bool:
        return all(request.completed for request in self._requests)

    def check_error(self) -> None:
        for request in self._requests:
            request.check_error()


def parse_readable(message: np.ndarray) -> tuple[int, list[tuple[int, int, int]]]:
    """The bulk number and the ``(address, key, length)`` of each buffer a
    READABLE announces (``ProtocolError`` if malformed)."""
    data = message.tobytes()
    if len(data) < _HEAD.size:
        raise ProtocolError(f"a {len(data)}-byte readable announcement")
    number, nbuffers = _HEAD.unpack_from(data)
    if not 0 < nbuffers <= MAX_BUFFERS or len(data) != _HEAD.size + nbuffers * _BUFFER.size:
        raise ProtocolError(f"a {len(data)}-byte readable announcement of {nbuffers} buffers")
    buffers = [_BUFFER.unpack_from(data, _HEAD.size + i * _BUFFER.size) for i in range(nbuffers)]
    return number, buffers


def read_message(number: int) -> bytes:
    """The READ that returns group ``number`` to its sender."""
    return _NUMBER.pack(number)


def parse_read(message: np.ndarray) -> int:
    """The bulk number a READ returns."""
    if message.nbytes != READ_BYTES:
        raise ProtocolError(f"a {message.nbytes}-byte read notice")
    return int(_NUMBER.unpack(message.tobytes())[0])
