"""The sampling thread of the memory benchmarks."""

from __future__ import annotations

import itertools
import threading
import time

from benchmarks._sampler import Sampler


def test_samples_while_in_the_block_and_once_on_leaving() -> None:
    counter = itertools.count(1)
    with Sampler(lambda: (next(counter), -1), 0.01) as sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    taken = len(sampler.samples)
    assert taken >= 4  # three or more while running, one on leaving
    assert sampler.peak() == (taken, -1)
    assert not any(t.name == "sampler" for t in threading.enumerate())
    time.sleep(0.05)
    assert len(sampler.samples) == taken


def test_peak_of_a_window_or_else_the_last_sample() -> None:
    sampler = Sampler(lambda: (0,), 1.0)
    sampler.samples = [(1.0, 5), (2.0, 9), (3.0, 7)]
    assert sampler.peak(2.5, 3.5) == (7,)
    assert sampler.peak(0.0, 2.0) == (9,)
    assert sampler.peak(10.0, 11.0) == (7,)
