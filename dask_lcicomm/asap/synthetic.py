"""A deterministic synthetic problem: L2-regularised logistic regression on
sparse, text-like features, trained by mini-batch SGD.

Features are many (tens of thousands, so one model message is hundreds of KB)
and each sample has few non-zeros, with a skewed frequency as words have;
labels come from a hidden linear model plus noise. Samples are stored as
``(indices, values)`` rows of fixed width, so everything is plain numpy: a
sparse product is a gather, a sparse gradient a ``bincount``. The optimum
``f*`` comes from a centralised full-batch solver (:meth:`solve`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

logger = logging.getLogger(__name__)

_TEST = 1_000_003  # stream id of the held-out set (ranks are small numbers)


@dataclass(frozen=True)
class Rows:
    """Fixed-width sparse rows: sample ``k`` is ``sum(values[k] * e[indices[k]])``."""

    indices: np.ndarray  # (samples, nnz) int64
    values: np.ndarray  # (samples, nnz) float64
    labels: np.ndarray  # (samples,) +-1.0

    def margins(self, w: np.ndarray) -> np.ndarray:
        return np.einsum("ij,ij->i", self.values, w[self.indices])

    def transpose_times(self, coef: np.ndarray, n_features: int) -> np.ndarray:
        """``X.T @ coef``."""
        weights = (self.values * coef[:, None]).ravel()
        return np.bincount(self.indices.ravel(), weights=weights, minlength=n_features)

    def take(self, rows: np.ndarray) -> Rows:
        return Rows(self.indices[rows], self.values[rows], self.labels[rows])


@dataclass(frozen=True)
class SparseLogReg:
    """The problem and its SGD hyper-parameters (see the module docstring)."""

    n_features: int = 32768
    nworkers: int = 8
    samples_per_worker: int = 4096
    n_test: int = 8192
    nnz: int = 32
    l2: float = 3e-4
    noise: float = 0.5
    skew: float = 3.0  # feature index = n_features * u**skew: low indices frequent
    decay: float = 16.0  # hidden weight of feature k falls as 1/(1 + k/decay)
    signal: float = 8.0  # scale of the hidden weights
    batch: int = 32
    lr: float = 8.0
    seed: int = 0

    # ---- data ---------------------------------------------------------------
    def shard(self, rank: int) -> Rows:
        """Rank ``rank``'s training samples (the held-out set for ``_TEST``)."""
        return _rows(self, rank)

    def train_rows(self) -> Rows:
        return _train_rows(self)

    def _truth(self) -> np.ndarray:
        return _truth(self)

    # ---- the Task protocol --------------------------------------------------
    def setup(self, rank: int, nworkers: int) -> None:
        if nworkers != self.nworkers:
            raise ValueError(f"problem made for {self.nworkers} workers, run on {nworkers}")
        self.shard(rank)

    def init_model(self) -> np.ndarray:
        return np.zeros(self.n_features)

    def local_step(self, model: np.ndarray, rank: int, round: int) -> np.ndarray:
        rows = self.shard(rank)
        rng = np.random.default_rng([self.seed, rank, round])
        batch = rows.take(rng.integers(0, rows.labels.size, self.batch))
        return model - self.lr * self.gradient(model, batch)

    def loss(self, model: np.ndarray) -> float:
        return self.objective(model, self.train_rows())

    def accuracy(self, model: np.ndarray) -> float:
        test = self.shard(_TEST)
        return float(np.mean(np.sign(test.margins(model)) == test.labels))

    # ---- the objective ------------------------------------------------------
    def objective(self, w: np.ndarray, rows: Rows) -> float:
        """Mean logistic loss plus ``l2/2 |w|^2``."""
        z = rows.labels * rows.margins(w)
        return float(np.mean(np.logaddexp(0.0, -z)) + 0.5 * self.l2 * (w @ w))

    def gradient(self, w: np.ndarray, rows: Rows) -> np.ndarray:
        z = rows.labels * rows.margins(w)
        coef = -rows.labels * _sigmoid(-z) / rows.labels.size
        return rows.transpose_times(coef, self.n_features) + self.l2 * w

    def solve(self, tol: float = 1e-10, max_iter: int = 5000) -> tuple[np.ndarray, float]:
        """``(w*, f*)`` by full-batch Nesterov acceleration with adaptive restart.

        Rows have unit norm, so the logistic part is 1/4-smooth at most and
        ``1/4 + l2`` is a safe step bound; the L2 term makes the problem
        ``l2``-strongly convex, hence linear convergence."""
        rows = self.train_rows()
        step = 1.0 / (0.25 + self.l2)
        x = y = self.init_model()
        f_prev = math.inf
        for it in range(max_iter):
            x_next = y - step * self.gradient(y, rows)
            f = self.objective(x_next, rows)
            if f > f_prev:  # restart momentum when it overshoots
                y, f_prev = x, math.inf
                continue
            y = x_next + (it / (it + 3)) * (x_next - x)
            x = x_next
            if f_prev - f < tol * max(1.0, abs(f)):
                break
            f_prev = f
        f_star = self.objective(x, rows)
        logger.info("f* = %.8f after %d iterations", f_star, it + 1)
        return x, f_star


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))


@lru_cache(maxsize=8)
def _truth(problem: SparseLogReg) -> np.ndarray:
    """The hidden model; its weight falls with feature rank, as word importance."""
    rng = np.random.default_rng([problem.seed, 0])
    scale = 1.0 / (1.0 + np.arange(problem.n_features) / problem.decay)
    return problem.signal * rng.normal(size=problem.n_features) * scale


@lru_cache(maxsize=16)
def _rows(problem: SparseLogReg, stream: int) -> Rows:
    rng = np.random.default_rng([problem.seed, 1, stream])
    samples = problem.n_test if stream == _TEST else problem.samples_per_worker
    # skewed feature frequencies: low indices are frequent, as common words
    u = rng.random((samples, problem.nnz))
    indices = np.minimum((problem.n_features * u**problem.skew).astype(np.int64), problem.n_features - 1)
    values = np.full((samples, problem.nnz), 1.0 / math.sqrt(problem.nnz))
    truth = _truth(problem)
    margin = np.einsum("ij,ij->i", values, truth[indices])
    labels = np.where(margin + problem.noise * rng.normal(size=samples) >= 0.0, 1.0, -1.0)
    return Rows(indices, values, labels)


@lru_cache(maxsize=4)
def _train_rows(problem: SparseLogReg) -> Rows:
    shards = [_rows(problem, rank) for rank in range(problem.nworkers)]
    return Rows(*(np.concatenate([getattr(s, f) for s in shards]) for f in ("indices", "values", "labels")))
