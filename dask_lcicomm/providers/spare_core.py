"""Whether a core would otherwise sit idle: the condition for polling.

Polling a ring instead of sleeping spares the peer a doorbell and this
process a wake-up, but it holds a core. That pays only while a core is free:
where runnable tasks outnumber the cores, a poller takes CPU from processes
with work to do (Dask graphs with four processes on two cores ran 4-15 %
slower with unconditional polling). The kernel's count of runnable tasks (the
fourth field of ``/proc/loadavg``, the caller included) against the cores
this process may run on says which case holds. It is read at most once per
``period``, and opened and closed each time, so that no descriptor outlives
a reading.
"""

from __future__ import annotations

import os

LOADAVG = "/proc/loadavg"


def runnable_tasks(text: bytes) -> int:
    """The number of runnable tasks in a ``/proc/loadavg`` line."""
    fields = text.split()
    if len(fields) < 4 or b"/" not in fields[3]:
        raise ValueError(f"not a loadavg line: {text!r}")
    return int(fields[3].partition(b"/")[0])


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


class SpareCore:
    """Answers "is a core free now?" from readings at most ``period`` apart.

    Without ``/proc/loadavg`` the answer is always no: never polling is the
    safe side.
    """

    def __init__(self, period: float, path: str = LOADAVG) -> None:
        self._period = period
        self._path = path
        self._cores = usable_cores()
        self._next = float("-inf")
        self._spare = False

    def __call__(self, now: float) -> bool:
        """``now`` is ``time.monotonic()``."""
        if now >= self._next:
            self._next = now + self._period
            self._spare = self._read() <= self._cores
        return self._spare

    def _read(self) -> float:
        try:
            fd = os.open(self._path, os.O_RDONLY)
            try:
                text = os.read(fd, 256)
            finally:
                os.close(fd)
            return runnable_tasks(text)
        except (OSError, ValueError):
            return float("inf")
