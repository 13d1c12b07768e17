"""What the runtime needs from a learning problem: a local step per worker
and the numbers it is judged by."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Task(Protocol):
    """A data-parallel learning problem; must pickle (it travels to workers)."""

    def setup(self, rank: int, nworkers: int) -> None:
        """Load or make rank ``rank``'s data; runs before the clock starts."""
        ...

    def init_model(self) -> np.ndarray:
        """The model every worker starts from (a float64 vector)."""
        ...

    def local_step(self, model: np.ndarray, rank: int, round: int) -> np.ndarray:
        """One step on the worker's data; returns a new array (``model`` is
        shared with the exchange and must not be modified)."""
        ...

    def loss(self, model: np.ndarray) -> float:
        """The global training objective (evaluated after the run)."""
        ...

    def accuracy(self, model: np.ndarray) -> float:
        """Held-out accuracy (evaluated after the run)."""
        ...
