"""How completions travel from whoever makes progress to the event loop.

Progress (a dedicated thread, or the event loop itself) turns network activity
into completions: a message arrived, a send finished, a device was lost. Two
ways to hand them over are provided so that the difference can be measured,
as in the LCI paper:

- :class:`CompletionQueue` collects completions and hands them to the event
  loop in batches: at most one wake-up of the loop per progress batch, however
  many completions it carried.
- :class:`Synchronizer` signals every operation on its own: one wake-up per
  completion, the way per-request tests (MPI_Test) behave.

Both take ``threadsafe=True`` when progress runs outside the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

Handler = Callable[[list[Any]], None]


class Completion(Protocol):
    def push(self, item: Any) -> None:
        """Record one completion."""

    def flush(self) -> None:
        """End of a progress batch: make the recorded completions visible."""


class CompletionQueue:
    """Completions drained in batches on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Handler, threadsafe: bool):
        self._loop = loop
        self._handler = handler
        self._threadsafe = threadsafe
        self._items: deque[Any] = deque()
        self._armed = False
        self.wakeups = 0

    def push(self, item: Any) -> None:
        self._items.append(item)

    def flush(self) -> None:
        if not self._items:
            return
        if not self._threadsafe:
            self.drain()
        elif not self._armed:
            self._armed = True
            self.wakeups += 1
            _call_soon_threadsafe(self._loop, self.drain)

    def drain(self) -> None:
        """Hand every queued completion to the handler (on the event loop).

        Handling may complete more operations (a closed device reports its
        loss); those are drained in the same call.
        """
        self._armed = False
        items = self._items
        while items:
            batch = [items.popleft() for _ in range(len(items))]
            self._handler(batch)


class Synchronizer:
    """One signal per completion: the per-operation alternative."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Handler, threadsafe: bool):
        self._loop = loop
        self._handler = handler
        self._threadsafe = threadsafe
        self.wakeups = 0

    def push(self, item: Any) -> None:
        self.wakeups += 1
        if self._threadsafe:
            _call_soon_threadsafe(self._loop, self._handler, [item])
        else:
            self._handler([item])

    def flush(self) -> None:
        pass


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Schedule ``fn`` on ``loop``, unless the loop is already closed: then
    nobody is left to be told (a progress thread finishing its last device)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def make_completion(
    kind: str, loop: asyncio.AbstractEventLoop, handler: Handler, threadsafe: bool
) -> Completion:
    """The completion object named by ``distributed.comm.lci.completion``."""
    kinds: dict[str, type[CompletionQueue | Synchronizer]] = {
        "queue": CompletionQueue, "sync": Synchronizer
    }
    return kinds[kind](loop, handler, threadsafe)
