"""A single-producer, single-consumer byte ring in a shared segment.

The sender copies parcel bytes into the ring and publishes them by advancing
TAIL; the receiver copies them out and returns the space by advancing HEAD
(its *credits*). Both counters only grow; ``TAIL - HEAD`` is what is in the
ring. The bytes are ordinary memory: what makes them visible to the other
process in the right order are the release store of a counter after the
copy and the acquire load of it before reading (C11 atomics in
:mod:`._atomics`), which matters on weakly ordered CPUs such as aarch64.

Neither side polls. A side that has nothing to do says so in a flag and
sleeps in ``epoll`` on the device's Unix socket; the other rings a doorbell
(one byte on that socket) only when it sees the flag:

* the receiver sets ASLEEP, then reads TAIL; the sender advances TAIL, then
  reads ASLEEP;
* the sender sets WAITING, then reads HEAD; the receiver advances HEAD, then
  reads WAITING.

Each side issues a sequentially consistent fence between its store and its
load, so at least one of them sees the other's store (the classic store-buffer
litmus test cannot end with both loads stale): either the sleeper finds the
work, or the worker sees the flag, clears it and rings. A missed wake-up is
impossible; a spurious one only costs an empty look at the ring.

The sender alone writes the free space ``[TAIL, HEAD + size)`` and the
receiver never reads it, so the sender may give its whole pages back to the
OS whenever it is not writing (:meth:`RingWriter.free_pages`): an idle ring
costs no memory, and the next lap faults fresh pages in.

Counters written by the peer are checked: a ring that claims more than its
size, or credits never handed out, is a protocol error, not a crash.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers._atomics import Region, fence
from dask_lcicomm.providers.shm_segment import ASLEEP, HEAD, PAGE, TAIL, WAITING, Layout, round_up


class RingWriter:
    """The sending side of a ring in a segment the receiver granted."""

    def __init__(self, region: Region, layout: Layout) -> None:
        self._region = region
        self._start = layout.ring_offset
        self._size = layout.ring_bytes
        self._tail = region.load(TAIL)
        self._head = region.load(HEAD)
        self.full = False
        # (tail, head) when the free pages were last named: nothing new since.
        self._named_free: tuple[int, int] | None = None

    def write(self, buffers: Iterable[Any], skip: int = 0) -> int:
        """Copy the bytes of ``buffers`` after the first ``skip`` into the
        ring, as many as fit, and publish them; ``full`` says whether the ring
        ran out of space."""
        size, start, region = self._size, self._start, self._region
        free = size - (self._tail - self._head)
        if free < size // 2:
            self._refresh_head()
            free = size - (self._tail - self._head)
        tail = self._tail
        written = 0
        for buffer in buffers:
            view = memoryview(buffer)
            n = view.nbytes
            if skip >= n:
                skip -= n
                continue
            if skip:
                view = view.cast("B")[skip:]
                n -= skip
                skip = 0
            if n > free:
                view = view.cast("B")[:free]
                n = free
            position = tail % size
            first = min(n, size - position)
            region.write(start + position, view[:first] if first < n else view)
            if first < n:
                region.write(start, view[first:])
            tail += n
            free -= n
            written += n
            if not free:
                break
        self.full = not free
        if written:
            self._tail = tail
            region.store(TAIL, tail)
        return written

    def wait_for_space(self) -> bool:
        """Arm WAITING for a doorbell when credits return; True if space
        came back meanwhile (then keep writing: nobody will ring)."""
        region = self._region
        region.exchange(WAITING, 1)
        fence()
        self._refresh_head()
        if self._tail - self._head < self._size:
            region.exchange(WAITING, 0)
            return True
        return False

    def wake_receiver(self) -> bool:
        """After publishing: True if the receiver sleeps and must be rung."""
        fence()
        region = self._region
        return bool(region.load(ASLEEP) and region.exchange(ASLEEP, 0))

    def free_pages(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` in the segment of the whole pages of free ring
        space (none of the page that holds the tail), unless named already."""
        self._refresh_head()
        if self._named_free == (self._tail, self._head):
            return []
        self._named_free = (self._tail, self._head)
        first, end = round_up(self._tail, PAGE), (self._head + self._size) // PAGE * PAGE
        if end <= first:
            return []
        position, nbytes = first % self._size, end - first
        head_part = min(nbytes, self._size - position)
        pages = [(self._start + position, head_part)]
        if nbytes > head_part:
            pages.append((self._start, nbytes - head_part))
        return pages

    def _refresh_head(self) -> None:
        head = self._region.load(HEAD)
        if not self._tail - self._size <= head <= self._tail:
            raise ProtocolError(f"peer returned ring credits it never had (head {head}, tail {self._tail})")
        self._head = head


class RingReader:
    """The receiving side of a ring in our own segment."""

    def __init__(self, region: Region, layout: Layout) -> None:
        self._region = region
        self._start = layout.ring_offset
        self._size = layout.ring_bytes
        self._head = region.load(HEAD)
        self._tail = self._head
        self.asleep = bool(region.load(ASLEEP))

    def read_into(self, buffer: memoryview) -> int:
        """Copy up to ``len(buffer)`` bytes out of the ring and return the space."""
        if self._tail == self._head:
            self._refresh_tail()
            if self._tail == self._head:
                return 0
        size, start, region = self._size, self._start, self._region
        n = min(self._tail - self._head, buffer.nbytes)
        position = self._head % size
        first = min(n, size - position)
        region.read_into(start + position, buffer[:first])
        if first < n:
            region.read_into(start, buffer[first:n])
        self._head += n
        region.store(HEAD, self._head)
        return n

    def sender_waiting(self) -> bool:
        """After returning space: True if the sender waits for it and must be rung."""
        fence()
        region = self._region
        return bool(region.load(WAITING) and region.exchange(WAITING, 0))

    def sleep(self) -> bool:
        """Arm ASLEEP for a doorbell; True if the ring is indeed empty,
        False if bytes arrived meanwhile (then keep reading)."""
        region = self._region
        region.exchange(ASLEEP, 1)
        fence()
        self._refresh_tail()
        if self._tail == self._head:
            self.asleep = True
            return True
        # Awake again: the sender, seeing the flag cleared, will not ring.
        region.exchange(ASLEEP, 0)
        self.asleep = False
        return False

    def woken(self) -> None:
        """A doorbell rang: the sender cleared ASLEEP."""
        self.asleep = False

    def _refresh_tail(self) -> None:
        tail = self._region.load(TAIL)
        if not self._head <= tail <= self._head + self._size:
            raise ProtocolError(f"peer overran the ring (tail {tail}, head {self._head})")
        self._tail = tail
