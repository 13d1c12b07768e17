"""Giving idle shared memory back to the OS, once per event loop.

A segment's pages are committed as the sender first writes them and would
stay so while the device lives: a ring that cycled once holds all its pages,
a pool all it ever lent. Only the sender may give them back, since it alone
writes the free ring space and the free pool blocks (see :mod:`.shm_ring`,
:mod:`.shm_pool`); and it should not while it sends, or every frame would
fault its pages in again.

So a device that sent is *watched*: one timer per event loop, not one per
device, looks at the watched devices every ``period``, and each gives back
its free ring space and the pool blocks that have been free for a whole
period. A busy device thus faults each page in again at most once a period,
not once a frame; a device with a steady trickle of small messages (Dask's
heartbeats) still gives its memory back. A device stays watched while it
sends and while blocks it lent are in use, so that they are given back after
their objects die; when nothing is watched the timer stops: an idle process
has no timer running.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Protocol


class Releasing(Protocol):
    #: Set (before :meth:`MemoryReleaser.watch`) by every send; cleared by a look.
    sent: bool

    def release_idle_memory(self) -> bool:
        """Give back what is idle; True when nothing is left to watch."""


class MemoryReleaser:
    """The watched devices of one event loop and the timer that looks at them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period: float) -> None:
        # Weakly: releaser() keeps a loop's releasers as long as the loop
        # lives, which a strong reference from them would make forever.
        self._loop = weakref.ref(loop)
        self._period = period
        self._lock = threading.Lock()
        self._watched: set[Releasing] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._arming = False

    def watch(self, device: Releasing) -> None:
        """Look at ``device`` from now on; any thread may call this."""
        with self._lock:
            self._watched.add(device)
            if self._timer is not None or self._arming:
                return
            self._arming = True
        loop = self._loop()
        if loop is not None:
            loop.call_soon_threadsafe(self._arm)

    def forget(self, device: Releasing) -> None:
        """``device`` is gone; the timer stops when nothing else is watched."""
        with self._lock:
            self._watched.discard(device)

    def _arm(self) -> None:
        loop = self._loop()  # alive: it runs this
        with self._lock:
            self._arming = False
            if self._timer is None and self._watched and loop is not None:
                self._timer = loop.call_later(self._period, self._look)

    def _look(self) -> None:
        loop = self._loop()
        with self._lock:
            self._timer = None
            watched = list(self._watched)
        done = [device for device in watched if device.release_idle_memory()]
        with self._lock:
            # One that sent meanwhile stays: its watch() found it watched.
            self._watched.difference_update(device for device in done if not device.sent)
            if self._watched and loop is not None and not loop.is_closed():
                self._timer = loop.call_later(self._period, self._look)


_releasers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, MemoryReleaser]] = (
    weakref.WeakKeyDictionary()
)


def releaser(period: float) -> MemoryReleaser:
    """The running event loop's releaser for ``period``."""
    loop = asyncio.get_running_loop()
    by_period = _releasers.setdefault(loop, {})
    found = by_period.get(period)
    if found is None:
        found = by_period[period] = MemoryReleaser(loop, period)
    return found
