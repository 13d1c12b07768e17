"""The sends a message device posted that the fabric has not finished.

A writer that does not yield to the event loop can leave tens of thousands
of small sends in flight, and the device looks for finished ones at every
write: looking through all of them each time made a flood quadratic. So
sends are taken back oldest first, as far as they are finished, which costs
nothing per write beyond the sends finished (a send finished behind one
still under way waits for it: it only holds stream bytes in the count).
The bulk messages of held parcels are kept apart and looked at every time,
since their completion is what lets a held parcel go, and they are few.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_verbs import Request

#: A send: its request, the stream bytes it holds, the message (kept alive
#: while the fabric reads it) and the held parcel it is a bulk message of.
Send = tuple[Request, int, Any, Held | None]


class SendsInFlight:
    """The unfinished sends of one device, in the order they were posted."""

    def __init__(self) -> None:
        self._sends: deque[Send] = deque()
        self._bulk: list[Send] = []

    def __bool__(self) -> bool:
        return bool(self._sends or self._bulk)

    def __iter__(self) -> Iterator[Send]:
        yield from self._sends
        yield from self._bulk

    def add(self, send: Send) -> None:
        (self._sends if send[3] is None else self._bulk).append(send)

    def finished(self) -> list[Send]:
        """Take back the sends the fabric has finished (see above)."""
        done: list[Send] = []
        sends = self._sends
        while sends and sends[0][0].completed:
            done.append(sends.popleft())
        if self._bulk:
            waiting: list[Send] = []
            for send in self._bulk:
                (done if send[0].completed else waiting).append(send)
            self._bulk = waiting
        return done

    def clear(self) -> None:
        self._sends.clear()
        self._bulk.clear()
