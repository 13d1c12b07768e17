"""The shared memory one process may hold in its peers' segments, over all peers.

Every pool block a sender lends stays committed until the receiver frees the
objects made of it, and Dask keeps what it receives: without a bound, a
process's shared memory would grow with its number of peers and with how
long its peers keep its frames. So the senders of one process share one
budget (``distributed.comm.lci.shm.budget``): a large frame goes into a pool
block only while the blocks lent and the rings written since they were last
given back stay within it; otherwise the receiver reads it from the
sender's memory (:mod:`.shm_reads`) or it travels through the ring, and
either way it lands in private memory, as ``tcp://`` receives it.

A ring is charged whole while its device has sent since memory was last
given back (see :mod:`.shm_release`), and it is never refused: the ring is
what always makes progress. Busy rings thus leave less room for lending.

Whether a lent block came back is known from its flag word in shared memory
(the receiver sets it, see :mod:`.shm_pool`): when a lend does not fit, the
budget looks at the flags of what it has lent before it says no, so that a
block freed by the receiver counts as free before its own sender has
collected it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable


class SharedMemoryBudget:
    """Bytes of shared memory lent or written, against a limit; thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        # key -> (bytes, whether the receiver has given them back)
        self._lent: dict[Hashable, tuple[int, Callable[[], bool]]] = {}
        self._charged: dict[Hashable, int] = {}

    @property
    def held(self) -> int:
        return self._held

    def lend(self, key: Hashable, nbytes: int, returned: Callable[[], bool]) -> bool:
        """Count ``nbytes`` lent under ``key`` if they fit; ``returned()``
        tells whether the receiver has freed them (any thread may ask)."""
        with self._lock:
            if self._held + nbytes > self.limit:
                self._credit_returned()
                if self._held + nbytes > self.limit:
                    return False
            self._lent[key] = (nbytes, returned)
            self._held += nbytes
            return True

    def charge(self, key: Hashable, nbytes: int) -> None:
        """Count ``nbytes`` written under ``key`` (a ring), whatever is left."""
        with self._lock:
            self._held += nbytes - self._charged.get(key, 0)
            self._charged[key] = nbytes

    def give(self, key: Hashable) -> None:
        """What ``key`` held is back (or no longer ours); no-op if counted back already."""
        with self._lock:
            lent = self._lent.pop(key, None)
            if lent is not None:
                self._held -= lent[0]
            self._held -= self._charged.pop(key, 0)

    def _credit_returned(self) -> None:
        for key in [key for key, (_, returned) in self._lent.items() if returned()]:
            self._held -= self._lent.pop(key)[0]


@functools.cache
def budget(limit: int) -> SharedMemoryBudget:
    """The process's budget for ``limit`` bytes (one per configured value)."""
    return SharedMemoryBudget(limit)
