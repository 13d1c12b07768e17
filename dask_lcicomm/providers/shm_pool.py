"""The sender's view of a receiver's pool: which blocks it may write now.

Large frames are written once, by the sender, into a block of the pool in
the receiver's segment; the receiver hands that very memory to the
deserializer and keeps it as long as any object uses it. When the last one
is freed, the receiver stores 1 in the block's flag word (see
:class:`._atomics.Lease`), from whatever thread the object died on. The
sender, sole owner of the allocation state, collects such blocks before
each allocation: no message and no lock cross the processes.

Memory freed by its last user stays committed while it is reused, so that
the next frame finds its pages: asked periodically,
:meth:`PoolAllocator.idle_free` names the extents that came back before it
was last asked and were not handed out since, for the device to give back
to the OS.

The pool is bounded, and so is what all the pools of a process lend
together (:mod:`.shm_budget`): when no block fits, :meth:`PoolAllocator.allocate`
returns None and the frames are read in place by the receiver
(:mod:`.shm_reads`) or go through the ring, which always makes progress
because the receiver empties it as it decodes, however long the
deserialized objects live.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from dask_lcicomm.providers.shm_budget import SharedMemoryBudget
from dask_lcicomm.providers.shm_segment import round_up

ALIGN = 4096


class PoolAllocator:
    """First-fit allocation of page-aligned blocks in ``[0, nbytes)``.

    ``returned(block)`` tells whether the receiver has freed ``block``;
    ``claim(block)`` marks it in use before the sender writes it. What is
    lent counts against ``budget`` until it comes back or :meth:`close`.
    """

    def __init__(
        self,
        nbytes: int,
        blocks: int,
        returned: Callable[[int], bool],
        claim: Callable[[int], None],
        budget: SharedMemoryBudget | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._returned = returned
        self._claim = claim
        self._budget = budget
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._handles = list(range(blocks - 1, -1, -1))
        self._used: dict[int, tuple[int, int]] = {}
        # Extents taken back since the last idle_free(), and before it
        # (written, maybe handed out again since); extents handed out since.
        self._taken_back: list[tuple[int, int]] = []
        self._aging: list[tuple[int, int]] = []
        self._handed_out: list[tuple[int, int]] = []

    @property
    def in_use(self) -> int:
        """Blocks written and not yet returned (as far as last collected)."""
        return len(self._used)

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """``(block, offset)`` of ``nbytes`` of fresh memory, or None if none fits."""
        size = round_up(nbytes, ALIGN)
        if not 0 < size <= self.nbytes:
            return None
        # Collect first, so that first fit reuses the lowest, recently used
        # memory: its pages are resident and mapped on both sides, while
        # untouched ones cost a page fault per page on each side.
        self._collect()
        found = self._find(size)
        if found is None or not self._handles:
            return None
        # Taken in one step: a handle lent for reading comes back from the
        # progress thread (give_handle) while we allocate.
        block = self._handles.pop()
        # Claimed before it is lent: the budget must not see the flag of the
        # block's previous use.
        self._claim(block)
        budget = self._budget
        if budget is not None and not budget.lend((self, block), size, lambda: self._returned(block)):
            self._handles.append(block)
            return None
        index, (offset, length) = found
        if length == size:
            del self._free[index]
        else:
            self._free[index] = (offset + size, length - size)
        self._used[block] = (offset, size)
        self._handed_out.append((offset, size))
        return block, offset

    def take_handle(self) -> int | None:
        """A free block handle, claimed, with no pool memory (for a group
        the receiver reads from the sender, see :mod:`.shm_reads`); None if
        every handle is out."""
        if not self._handles:
            return None
        block = self._handles.pop()
        self._claim(block)
        return block

    def give_handle(self, block: int) -> None:
        """A handle from :meth:`take_handle` that came back."""
        self._handles.append(block)

    def close(self) -> None:
        """The segment is no longer ours: what is lent leaves the budget."""
        if self._budget is not None:
            for block in self._used:
                self._budget.give((self, block))

    @property
    def settled(self) -> bool:
        """Nothing lent, and nothing taken back that idle_free() has yet to name."""
        return not (self._used or self._taken_back or self._aging)

    def idle_free(self) -> list[tuple[int, int]]:
        """Take back what the receiver freed; ``(offset, nbytes)`` of the
        memory taken back before the previous call and neither handed out
        since nor in use now, whose pages may be given back."""
        self._collect()
        aged, busy = self._aging, self._handed_out
        self._aging, self._taken_back, self._handed_out = self._taken_back, [], []
        # What was reused within the period stays committed for the next frame.
        return _minus(_merged(aged), _merged(busy + list(self._used.values())))

    def _find(self, size: int) -> tuple[int, tuple[int, int]] | None:
        for index, extent in enumerate(self._free):
            if extent[1] >= size:
                return index, extent
        return None

    def _collect(self) -> None:
        """Take back every block the receiver has freed."""
        for block in [block for block in self._used if self._returned(block)]:
            self._release(block)

    def _release(self, block: int) -> None:
        offset, size = self._used.pop(block)
        if self._budget is not None:
            self._budget.give((self, block))
        self._taken_back.append((offset, size))
        self._handles.append(block)
        free = self._free
        index = bisect.bisect(free, (offset, size))
        if index < len(free) and offset + size == free[index][0]:
            size += free[index][1]
            del free[index]
        if index and free[index - 1][0] + free[index - 1][1] == offset:
            offset = free[index - 1][0]
            size += free[index - 1][1]
            index -= 1
            del free[index]
        free.insert(index, (offset, size))


def _merged(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` extents sorted, overlapping and touching ones joined."""
    joined: list[tuple[int, int]] = []
    for offset, size in sorted(extents):
        if joined and joined[-1][0] + joined[-1][1] >= offset:
            last, last_size = joined[-1]
            joined[-1] = (last, max(last + last_size, offset + size) - last)
        else:
            joined.append((offset, size))
    return joined


def _minus(extents: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint ``extents`` outside sorted, disjoint ``holes``."""
    left: list[tuple[int, int]] = []
    for offset, size in extents:
        start, end = offset, offset + size
        for hole, hole_size in holes:
            if hole + hole_size <= start or hole >= end:
                continue
            if hole > start:
                left.append((start, hole - start))
            start = max(start, hole + hole_size)
        if start < end:
            left.append((start, end - start))
    return left
