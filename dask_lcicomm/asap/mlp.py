"""A non-convex problem: a multi-layer perceptron classifying synthetic data,
trained by mini-batch SGD, in numpy alone.

Each class is a union of ``clusters`` Gaussian blobs around random centres,
with noise wide enough that blobs of different classes overlap: the classes
are not linearly separable and no model gets every label right. The network
has one hidden tanh layer of ``hidden`` units; its parameters are
one float64 vector (the model message: 352 KB by default). Its loss is the
mean cross-entropy over a fixed evaluation subset of 1,024 of the workers'
training samples (a full pass per snapshot would cost more than the run), and
there is no known optimum: :meth:`MLP.solve` trains a reference centrally, with
large batches, to fix the target before any run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

logger = logging.getLogger(__name__)

_TEST = 1_000_003  # stream id of the held-out set (ranks are small numbers)


@dataclass(frozen=True)
class Samples:
    x: np.ndarray  # (samples, inputs) float64
    y: np.ndarray  # (samples,) int64 class labels

    def take(self, rows: np.ndarray) -> Samples:
        return Samples(self.x[rows], self.y[rows])


@dataclass(frozen=True)
class MLP:
    """The problem and its SGD hyper-parameters (see the module docstring)."""

    inputs: int = 32
    hidden: int = 1024
    classes: int = 10
    nworkers: int = 8
    samples_per_worker: int = 4096
    n_test: int = 4096
    #: Samples the loss is measured on, taken evenly from every worker's
    #: shard: a fixed number, so that evaluating every snapshot of a run does
    #: not cost more with more workers (at 4,096, 32 workers spent about a
    #: minute of this machine's two cores on it after every run).
    eval_samples_total: int = 1024
    clusters: int = 4  # blobs per class
    spread: float = 1.0  # of the samples around their blob's centre (centres: unit normal)
    batch: int = 32
    lr: float = 0.1
    seed: int = 0

    @property
    def n_params(self) -> int:
        return self.inputs * self.hidden + self.hidden + self.hidden * self.classes + self.classes

    # ---- data ---------------------------------------------------------------
    def shard(self, rank: int) -> Samples:
        """Rank ``rank``'s training samples (the held-out set for ``_TEST``)."""
        return _samples(self, rank)

    def eval_samples(self) -> Samples:
        """The fixed subset of the training samples the loss is measured on."""
        return _eval_samples(self)

    # ---- the Task protocol --------------------------------------------------
    def setup(self, rank: int, nworkers: int) -> None:
        if nworkers != self.nworkers:
            raise ValueError(f"problem made for {self.nworkers} workers, run on {nworkers}")
        self.shard(rank)
        self.eval_samples()

    def init_model(self) -> np.ndarray:
        """Glorot-scaled weights, zero biases; the same on every worker."""
        rng = np.random.default_rng([self.seed, 2])
        w1 = rng.normal(size=(self.inputs, self.hidden)) / np.sqrt(self.inputs)
        w2 = rng.normal(size=(self.hidden, self.classes)) / np.sqrt(self.hidden)
        return np.concatenate([w1.ravel(), np.zeros(self.hidden), w2.ravel(), np.zeros(self.classes)])

    def local_step(self, model: np.ndarray, rank: int, round: int) -> np.ndarray:
        samples = self.shard(rank)
        rng = np.random.default_rng([self.seed, rank, round])
        batch = samples.take(rng.integers(0, samples.y.size, self.batch))
        return model - self.lr * self.gradient(model, batch)

    def loss(self, model: np.ndarray) -> float:
        return self.objective(model, self.eval_samples())

    def accuracy(self, model: np.ndarray) -> float:
        test = self.shard(_TEST)
        return float(np.mean(np.argmax(self._forward(model, test.x)[1], axis=1) == test.y))

    # ---- the network --------------------------------------------------------
    def _unpack(self, model: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        i, h, c = self.inputs, self.hidden, self.classes
        w1 = model[: i * h].reshape(i, h)
        b1 = model[i * h : i * h + h]
        w2 = model[i * h + h : i * h + h + h * c].reshape(h, c)
        b2 = model[i * h + h + h * c :]
        return w1, b1, w2, b2

    def _forward(self, model: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden activations and class scores."""
        w1, b1, w2, b2 = self._unpack(model)
        a = np.tanh(x @ w1 + b1)
        return a, a @ w2 + b2

    def objective(self, model: np.ndarray, samples: Samples) -> float:
        """Mean cross-entropy."""
        _, scores = self._forward(model, samples.x)
        return float(np.mean(_log_sum_exp(scores) - scores[np.arange(samples.y.size), samples.y]))

    def gradient(self, model: np.ndarray, samples: Samples) -> np.ndarray:
        """Of :meth:`objective`, by backpropagation."""
        _, _, w2, _ = self._unpack(model)
        a, scores = self._forward(model, samples.x)
        p = np.exp(scores - _log_sum_exp(scores)[:, None])
        p[np.arange(samples.y.size), samples.y] -= 1.0
        p /= samples.y.size
        da = (p @ w2.T) * (1.0 - a * a)
        return np.concatenate([
            (samples.x.T @ da).ravel(), da.sum(axis=0), (a.T @ p).ravel(), p.sum(axis=0),
        ])

    def solve(self, steps: int = 600, batch: int = 512) -> tuple[np.ndarray, float]:
        """``(model, loss)`` of a reference trained centrally by SGD with
        momentum on large batches of all workers' samples: the loss the
        target is set against (a non-convex problem has no known optimum)."""
        shards = [self.shard(rank) for rank in range(self.nworkers)]
        every = Samples(np.concatenate([s.x for s in shards]), np.concatenate([s.y for s in shards]))
        rng = np.random.default_rng([self.seed, 3])
        model = self.init_model()
        velocity: np.ndarray = np.zeros(self.n_params)
        for _ in range(steps):
            grad = self.gradient(model, every.take(rng.integers(0, every.y.size, batch)))
            velocity = 0.9 * velocity - 4 * self.lr * grad
            model = model + velocity
        loss = self.loss(model)
        logger.info("reference loss %.6f after %d steps", loss, steps)
        return model, loss


def _log_sum_exp(scores: np.ndarray) -> np.ndarray:
    top = scores.max(axis=1)
    return top + np.log(np.exp(scores - top[:, None]).sum(axis=1))


@lru_cache(maxsize=4)
def _centres(problem: MLP) -> np.ndarray:
    rng = np.random.default_rng([problem.seed, 0])
    return rng.normal(size=(problem.classes * problem.clusters, problem.inputs))


@lru_cache(maxsize=16)
def _samples(problem: MLP, stream: int) -> Samples:
    rng = np.random.default_rng([problem.seed, 1, stream])
    n = problem.n_test if stream == _TEST else problem.samples_per_worker
    blob = rng.integers(0, problem.classes * problem.clusters, n)
    x = _centres(problem)[blob] + problem.spread * rng.normal(size=(n, problem.inputs))
    return Samples(x, (blob // problem.clusters).astype(np.int64))


@lru_cache(maxsize=4)
def _eval_samples(problem: MLP) -> Samples:
    k = max(1, problem.eval_samples_total // problem.nworkers)
    shards = [_samples(problem, rank) for rank in range(problem.nworkers)]
    return Samples(np.concatenate([s.x[:k] for s in shards]), np.concatenate([s.y[:k] for s in shards]))
