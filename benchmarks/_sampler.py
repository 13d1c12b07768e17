"""A thread that samples while a ``with`` block runs: it sees the peaks that a
reading before and after would miss; and the memory readings it samples."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress

import psutil


class Sampler:
    """``(time, *measure())`` every ``interval_s`` in the ``with`` block, and once on leaving it."""

    def __init__(self, measure: Callable[[], tuple[int, ...]], interval_s: float) -> None:
        self.measure, self.interval_s = measure, interval_s
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), *self.measure()))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()

    def peak(self, start: float = 0.0, end: float = float("inf")) -> tuple[int, ...]:
        """Each value's largest sample between ``start`` and ``end`` (monotonic), else the last."""
        window = [s[1:] for s in self.samples if start <= s[0] <= end] or [self.samples[-1][1:]]
        return tuple(max(column) for column in zip(*window, strict=True))


def proc_bytes(path: str, field: str) -> int:
    """A field in kB of a /proc file (``VmRSS:`` of /proc/self/status...), in bytes."""
    with open(path) as file:
        return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))


def pss(pids: Iterable[int]) -> int:
    """The processes' summed PSS in bytes (a page they share counts once); one gone counts 0."""
    total = 0
    for pid in pids:
        with suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().pss
    return total
