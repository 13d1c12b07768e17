"""The send queue of a device: parcels waiting for the fabric (LCI's backlog queue).

Units of parcels (see :mod:`dask_lcicomm.parcel`) of different virtual
connections are taken round-robin, one unit at a time, so a large frame never
holds small parcels of other comms behind it for its whole length. What was
taken waits in :attr:`SendQueue.out` until the fabric accepts it; units that
queued while the device was busy leave together, up to ``batch_bytes`` per
transmission (HPX's aggregation of parcels on a busy connection).

Pure bookkeeping: no sockets, no locks (the device serialises access), so it
is tested on its own.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

#: Most buffers handed to the fabric at once (the ``sendmsg`` limit).
IOV_MAX = 1024


class Unit(Protocol):
    """Something to send in units: :class:`~dask_lcicomm.parcel.OutgoingParcel` or raw bytes."""

    nbytes: int

    @property
    def done(self) -> bool: ...

    def next_unit(self) -> list[Any]: ...


class Raw:
    """A control message that goes out as one unit."""

    __slots__ = ("_data", "nbytes")

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self.nbytes = len(data)

    @property
    def done(self) -> bool:
        return self._data is None

    def next_unit(self) -> list[Any]:
        data, self._data = self._data, None
        return [data]


class SendQueue:
    """Per-vc streams of units, the buffers taken from them, and their tokens.

    A token queued with a unit source comes back from :meth:`consume` once
    the last byte of that source has been handed to the fabric, or from
    :meth:`clear` if it never will be: every token is returned exactly once.
    """

    def __init__(self, batch_bytes: int) -> None:
        self._batch_bytes = batch_bytes
        self._streams: dict[int, deque[tuple[Unit, Any]]] = {}
        self._ready: deque[int] = deque()
        #: Buffers taken from units, in order, not yet accepted by the fabric.
        self.out: deque[Any] = deque()
        # (byte count at which a source ends, its size, its token)
        self._marks: deque[tuple[int, int, Any]] = deque()
        self._taken = 0
        self._sent = 0
        #: Bytes of unit sources queued and not yet fully sent.
        self.queued_bytes = 0

    def push(self, vc: int, unit: Unit, token: Any = None) -> bool:
        """Queue ``unit`` on ``vc``; True when enough is queued to send at once."""
        stream = self._streams.get(vc)
        if stream is None:
            self._streams[vc] = stream = deque()
            self._ready.append(vc)
        stream.append((unit, token))
        self.queued_bytes += unit.nbytes
        return self.queued_bytes >= self._batch_bytes

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing taken: every token has come back."""
        return not self.out and not self._ready

    def push_first(self, vc: int, unit: Unit, token: Any = None) -> None:
        """:meth:`push` then :meth:`fill` on an :attr:`idle` queue: a unit
        taken whole at once (every small parcel) skips the round robin."""
        out = self.out
        taken = self._taken
        for buffer in unit.next_unit():
            out.append(buffer)
            taken += len(buffer)
        self._taken = taken
        self.queued_bytes += unit.nbytes
        if unit.done:
            self._marks.append((taken, unit.nbytes, token))
            return
        self._streams[vc] = deque([(unit, token)])
        self._ready.append(vc)
        self.fill()

    def fill(self) -> bool:
        """Take units into :attr:`out`, up to a batch; False when nothing is left."""
        streams, ready, out = self._streams, self._ready, self.out
        taken = start = self._taken
        while ready:
            vc = ready[0]
            stream = streams[vc]
            unit, token = stream[0]
            for buffer in unit.next_unit():
                out.append(buffer)
                taken += len(buffer)
            if unit.done:
                stream.popleft()
                self._marks.append((taken, unit.nbytes, token))
                if not stream:
                    del streams[vc]
                    ready.popleft()
                else:
                    ready.rotate(-1)
            else:
                ready.rotate(-1)
            if taken - start >= self._batch_bytes or len(out) >= IOV_MAX:
                break
        self._taken = taken
        return bool(out)

    def consume(self, n: int) -> list[Any]:
        """The fabric accepted ``n`` bytes of :attr:`out`: the tokens now done."""
        self._sent += n
        out = self.out
        while n:
            head = out[0]
            size = len(head)
            if n >= size:
                out.popleft()
                n -= size
            else:
                out[0] = memoryview(head)[n:]
                n = 0
        done = []
        marks, sent = self._marks, self._sent
        while marks and marks[0][0] <= sent:
            _, nbytes, token = marks.popleft()
            self.queued_bytes -= nbytes
            if token is not None:
                done.append(token)
        return done

    def clear(self) -> list[Any]:
        """Drop everything unsent; the tokens that will never be done."""
        tokens = [token for _, _, token in self._marks if token is not None]
        for stream in self._streams.values():
            tokens.extend(token for _, token in stream if token is not None)
        self._streams.clear()
        self._ready.clear()
        self.out.clear()
        self._marks.clear()
        self.queued_bytes = 0
        return tokens
