"""Private memory for large frames received from a peer, used again once Dask frees them.

Memory a process has not touched before costs more than the copy into it:
every page faults in and is zeroed, and ``tcp://`` receives every frame
into such memory. Here a large frame (a bulk group over a message fabric,
or a frame the shm provider reads in place) is received into a region of
its own, lent to Dask as the frame (a :class:`~._atomics.Lease`: freeing
the frame's last view marks the region free, as a shared-memory pool block
is returned), and the next frame of the same size class takes a free region
instead of new memory.

A region stays free at most about two periods of the event loop's
:class:`~.shm_release.MemoryReleaser`: a look unmaps the regions it found
free at the look before too. So a process holds no more than what Dask held
a period ago, and gives it back when idle, as the shared-memory pool does.
"""

from __future__ import annotations

import asyncio
import mmap
import threading
import weakref

import numpy as np

from dask_lcicomm.providers._atomics import Lease, Region
from dask_lcicomm.providers.shm_release import MemoryReleaser, releaser

#: Regions are made in whole huge pages (numpy's and the kernel's unit for
#: large buffers); a frame's size class is its size rounded up to one.
SIZE_CLASS = 2 * 1024 * 1024
_FLAG = 8  # the region's last word: 1 once its lease is freed
#: Smaller frames are left to malloc, which reuses its own memory: a region
#: would be at least twice their size.
LEAST_BYTES = SIZE_CLASS // 2


class _Region:
    __slots__ = ("address", "capacity", "mapping", "memory", "seen_free")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mapping.madvise(mmap.MADV_HUGEPAGE)
        self.memory = Region(self.mapping)
        self.address = np.frombuffer(self.mapping, np.uint8).ctypes.data
        self.seen_free = False

    @property
    def free(self) -> bool:
        return self.memory.load(self.capacity - _FLAG) == 1


class FrameMemory:
    """The regions of one event loop's shm devices; ``take`` may be called
    from any thread."""

    def __init__(self, releaser: MemoryReleaser) -> None:
        self._releaser = releaser
        self._lock = threading.Lock()
        self._regions: dict[int, list[_Region]] = {}
        #: Whether a frame was taken since the releaser last looked.
        self.sent = False

    @property
    def held_bytes(self) -> int:
        """Bytes of the regions mapped, lent or free."""
        with self._lock:
            return sum(r.capacity for regions in self._regions.values() for r in regions)

    def take(self, nbytes: int) -> tuple[Lease, int]:
        """A writable buffer of ``nbytes`` (``nbytes`` > 0, checked against
        the limits) and its address: a free region of its size class, or a
        new one."""
        capacity = -(-(nbytes + _FLAG) // SIZE_CLASS) * SIZE_CLASS
        with self._lock:
            regions = self._regions.setdefault(capacity, [])
            region = next((r for r in regions if r.free), None)
            if region is None:
                region = _Region(capacity)
                regions.append(region)
            region.memory.store(capacity - _FLAG, 0)
            region.seen_free = False
            lease = region.memory.lease(0, nbytes, capacity - _FLAG)
            first, self.sent = not self.sent, True
        if first:
            self._releaser.watch(self)
        return lease, region.address

    def array(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (checked against the limits)
        for a frame: a region's, from :data:`LEAST_BYTES` on."""
        if nbytes < LEAST_BYTES:
            return np.empty(nbytes, np.uint8)
        lease, _ = self.take(nbytes)
        return np.frombuffer(memoryview(lease), np.uint8)

    def release(self) -> None:
        """Keep no region: the free ones are unmapped now, the lent ones once
        their frames die (each lease holds its region)."""
        with self._lock:
            self._regions.clear()

    def release_idle_memory(self) -> bool:
        """Unmap the regions free at this look and the one before (their
        last reference goes); True when no region is left to watch."""
        with self._lock:
            for capacity, regions in list(self._regions.items()):
                kept = []
                for region in regions:
                    if region.free:
                        if region.seen_free:
                            continue
                        region.seen_free = True
                    kept.append(region)
                if kept:
                    self._regions[capacity] = kept
                else:
                    del self._regions[capacity]
            sent, self.sent = self.sent, False
            return not sent and not self._regions


_memories: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, FrameMemory]] = (
    weakref.WeakKeyDictionary()
)


def frame_memory(period: float) -> FrameMemory:
    """The running event loop's frame memory, looked at every ``period``."""
    by_period = _memories.setdefault(asyncio.get_running_loop(), {})
    found = by_period.get(period)
    if found is None:
        found = by_period[period] = FrameMemory(releaser(period))
    return found


def held_by_process() -> int:
    """Bytes of frame memory this process maps, over every event loop."""
    return sum(m.held_bytes for by_period in list(_memories.values()) for m in by_period.values())
