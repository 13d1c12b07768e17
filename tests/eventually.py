"""Checks of state that settles asynchronously."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.1) -> T:
    """What ``check()`` returns once it stops raising ``AssertionError``, tried
    for at most ``timeout`` seconds; after that its last failure is raised.

    For what a process shows while channels open around it: a channel opens
    over the bootstrap provider before it upgrades, and the accepting side
    drops that link only when the connecting side's end of it arrives, so a
    snapshot may catch a bootstrap link that no comm will ever use.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(interval)
