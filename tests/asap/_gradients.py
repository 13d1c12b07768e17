"""Checking a problem's gradient against central finite differences."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def assert_gradient_matches(problem: Any, model: np.ndarray, data: Any, coordinates: int,
                            seed: int = 0) -> None:
    """``problem.gradient(model, data)`` agrees with finite differences of
    ``problem.objective`` on ``coordinates`` random coordinates."""
    rng = np.random.default_rng(seed)
    grad = problem.gradient(model, data)
    for k in rng.choice(model.size, coordinates, replace=False):
        e = np.zeros_like(model)
        e[k] = 1e-6
        numeric = (problem.objective(model + e, data) - problem.objective(model - e, data)) / 2e-6
        assert grad[k] == pytest.approx(numeric, rel=1e-4, abs=1e-8)
