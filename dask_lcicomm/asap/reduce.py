"""The reduce rule: a worker's model becomes the mean of its own and the
models it received.

With equal weights on a regular graph the mixing matrix is doubly
stochastic, so the mean over workers is preserved and repeated reduces
converge to the all-reduce average; with an all-to-all exchange one reduce
*is* the all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def average(own: np.ndarray, others: Sequence[np.ndarray]) -> np.ndarray:
    """``(own + sum(others)) / (1 + len(others))`` as a new array."""
    total = np.array(own, dtype=np.float64, copy=True)
    for model in others:
        total += model
    if others:
        total /= len(others) + 1
    return total
