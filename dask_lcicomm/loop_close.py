"""Learn that tornado closes the IOLoop with its descriptors.

Dask runs its event loops through tornado, and tcp:// registers every socket
with tornado's IOLoop, so ``IOLoop.close(all_fds=True)`` (how Dask's test
harness and its subprocess helpers end a loop) closes the sockets of servers
nobody closed. lci:// descriptors are watched by the progress engine instead,
so a parcelport registers one stand-in descriptor with the IOLoop and releases
everything when tornado closes it. Without a tornado IOLoop on the event loop
there is no such close to follow, and nothing is registered.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tornado.ioloop import IOLoop


def _never_called(fileobj: object, events: int) -> None:
    """Registered for no events: the descriptor is never watched."""


class LoopCloseHook:
    """Runs ``on_close`` if the running tornado IOLoop is closed with
    ``all_fds=True`` before :meth:`cancel`; holds one eventfd until then."""

    def __init__(self, on_close: Callable[[], None]) -> None:
        self._on_close: Callable[[], None] | None = on_close
        self._ioloop = IOLoop.current(instance=False)
        self._fd = -1
        if self._ioloop is not None:
            self._fd = os.eventfd(0)
            self._ioloop.add_handler(self, _never_called, 0)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Tornado closes its descriptors (it unregistered this one first)."""
        on_close, self._on_close = self._on_close, None
        self._release()
        if on_close is not None:
            on_close()

    def cancel(self) -> None:
        """Stop following the IOLoop and give the descriptor back."""
        self._on_close = None
        if self._ioloop is not None and self._fd >= 0:
            self._ioloop.remove_handler(self)
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
