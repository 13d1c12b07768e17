"""Receive buffers shared by every decoder of the process (LCI's packet pool).

A stream is read into a buffer where parcel heads and small frames are
parsed; their frames are copied out, so between messages the buffer holds
nothing. A decoder therefore takes a buffer when bytes arrive and gives it
back as soon as everything in it is parsed: a process with a thousand quiet
peers keeps a few buffers, not a thousand.
"""

from __future__ import annotations

#: Buffers kept for reuse per size; more are freed when given back.
KEEP = 8


class PacketPool:
    """Free buffers of one size. ``take`` and ``give`` may be called from any
    thread: a list's ``pop`` and ``append`` are atomic."""

    def __init__(self, size: int, keep: int = KEEP) -> None:
        self.size = size
        self._keep = keep
        self._free: list[bytearray] = []

    def take(self) -> bytearray:
        try:
            return self._free.pop()
        except IndexError:
            return bytearray(self.size)

    def give(self, buffer: bytearray) -> None:
        """Keep ``buffer`` for reuse if it is of this pool's size and the pool
        is not full; otherwise it is freed with its last reference."""
        if len(buffer) == self.size and len(self._free) < self._keep:
            self._free.append(buffer)


_pools: dict[int, PacketPool] = {}


def packet_pool(size: int) -> PacketPool:
    """The process's pool of ``size``-byte buffers."""
    pool = _pools.get(size)
    if pool is None:
        pool = _pools.setdefault(size, PacketPool(size))
    return pool
