"""How a run tells the person at the terminal where it is.

The harness only knows how many steps (one benchmark, one configuration, one
round) a run has and when each one ends; it reports that through
:class:`Progress`.  The CLI shows it as a progress bar on stderr
(:class:`ProgressBar`), with one line per finished step written above the bar,
so stdout keeps just the tables; library callers and tests may stay silent
(:class:`Silent`).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from tqdm import tqdm


class Progress(Protocol):
    """Where a run reports its steps."""

    def start(self, title: str, total: int) -> None:
        """A run of ``total`` steps begins."""

    def step(self, line: str) -> None:
        """One step ended; ``line`` says how."""

    def note(self, line: str) -> None:
        """Something worth knowing that is not a step (a skipped configuration)."""


class Silent:
    """Reports nothing."""

    def start(self, title: str, total: int) -> None:
        pass

    def step(self, line: str) -> None:
        pass

    def note(self, line: str) -> None:
        pass


#: The default of every ``run``: no reports.
SILENT = Silent()


class ProgressBar:
    """A tqdm bar per run on stderr, finished lines printed above it.

    Use as a context manager: the last bar is closed on exit, also when the
    run is interrupted.
    """

    def __init__(self) -> None:
        self._bar: Any = None

    def start(self, title: str, total: int) -> None:
        self.close()
        self._bar = tqdm(total=total, desc=title, unit="step", file=sys.stderr,
                         dynamic_ncols=True, leave=True)

    def step(self, line: str) -> None:
        self.note(line)
        if self._bar is not None:
            self._bar.update(1)

    def note(self, line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
