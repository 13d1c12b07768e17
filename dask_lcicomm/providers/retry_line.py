"""The messages of one device that the fabric answered "retry" to.

They are posted again in the order they were first given, ahead of any
newer message, since a stream must arrive in order. How long the first of
them has waited is what tells a busy peer from one the fabric cannot reach.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_verbs import Request

#: A message, its tag, the stream bytes it holds and the held parcel it is
#: a bulk message of.
Unposted = tuple[Any, int, int, Held | None]


class RetryLine(deque[Unposted]):
    """Unposted messages, oldest first (a deque: its truth is asked at every
    post, and a deque answers without a call into Python)."""

    def __init__(self) -> None:
        super().__init__()
        self._since = 0.0

    def append(self, message: Unposted) -> None:
        if not self:
            self._since = time.monotonic()
        super().append(message)

    def post(self, send: Callable[[int, Any], Request | None]) -> Iterator[tuple[Request, Unposted]]:
        """Post the messages in order with ``send(tag, message)`` while the
        fabric takes them; yield each taken one with its request."""
        while self:
            request = send(self[0][1], self[0][0])
            if request is None:
                return
            self._since = time.monotonic()
            yield request, self.popleft()

    @property
    def waited(self) -> float:
        """Seconds since the fabric last took a message of the line, or
        since the first was refused."""
        return time.monotonic() - self._since
