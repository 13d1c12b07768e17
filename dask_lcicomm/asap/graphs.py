"""Communication graphs for decentralised averaging, judged by their spectral gap.

A worker averages its model with those of its in-neighbours, so one round of
averaging multiplies the stacked models by the mixing matrix ``W`` (row ``i``:
weight ``1/(d_in+1)`` on ``i`` and each in-neighbour). How fast repeated
rounds reach the global average is governed by the spectral gap
``1 - |lambda_2(W)|``: 1 for all-to-all (one round is exact), near 0 for a
graph that is nearly bipartite or disconnected. Constructions are only
candidates: :func:`choose_graph` computes every candidate's gap numerically and
keeps the best one under a degree budget, because a construction that mixes
well at one size can be nearly bipartite, or fall apart, at another.

Every graph built here is regular (in-degree = out-degree), so ``W`` is doubly
stochastic and averaging preserves the mean: repeated rounds converge to the
same result as an all-reduce.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Graph:
    """A directed graph on ranks ``0..n-1``: ``out[i]`` are the ranks ``i`` sends to."""

    name: str
    out: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.out)
        for i, peers in enumerate(self.out):
            if len(set(peers)) != len(peers) or any(not 0 <= j < n or j == i for j in peers):
                raise ValueError(f"{self.name}: bad out-neighbours of {i}: {peers}")

    @property
    def n(self) -> int:
        return len(self.out)

    @cached_property
    def inn(self) -> tuple[tuple[int, ...], ...]:
        """``inn[i]``: the ranks that send to ``i``."""
        incoming: list[list[int]] = [[] for _ in range(self.n)]
        for i, peers in enumerate(self.out):
            for j in peers:
                incoming[j].append(i)
        return tuple(tuple(sorted(peers)) for peers in incoming)

    @property
    def degree(self) -> int:
        """The largest out-degree: models a worker sends per round."""
        return max((len(p) for p in self.out), default=0)

    def mixing_matrix(self) -> np.ndarray:
        """``W`` with ``W[i, j] = 1/(d_in(i)+1)`` for ``j`` in ``{i} | inn[i]``."""
        w = np.zeros((self.n, self.n))
        for i, peers in enumerate(self.inn):
            w[i, [i, *peers]] = 1.0 / (len(peers) + 1)
        return w

    @cached_property
    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of the mixing matrix (0 when it does not mix)."""
        return spectral_gap(self.mixing_matrix())

    @cached_property
    def diameter(self) -> float:
        """Longest shortest directed path; ``inf`` if not strongly connected."""
        longest = 0
        for source in range(self.n):
            dist = {source: 0}
            queue = deque([source])
            while queue:
                i = queue.popleft()
                for j in self.out[i]:
                    if j not in dist:
                        dist[j] = dist[i] + 1
                        queue.append(j)
            if len(dist) < self.n:
                return math.inf
            longest = max(longest, *dist.values())
        return float(longest)


def spectral_gap(w: np.ndarray) -> float:
    """``1 - |second largest eigenvalue modulus|`` of a stochastic matrix."""
    if w.shape[0] < 2:
        return 1.0
    moduli = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(max(0.0, 1.0 - moduli[1]))


def all_to_all(n: int) -> Graph:
    """Everybody sends to everybody: the averaging of BSP all-reduce (gap 1)."""
    return Graph("all-to-all", tuple(tuple(j for j in range(n) if j != i) for i in range(n)))


def ring(n: int) -> Graph:
    """``i -> i+1``: the topology of ring all-reduce (not a good averaging graph)."""
    return circulant(n, [1], name="ring")


def circulant(n: int, offsets: Iterable[int], name: str | None = None) -> Graph:
    """``i -> i+k (mod n)`` for each offset ``k`` (zero and repeats dropped)."""
    unique: list[int] = []
    for k in offsets:
        k %= n
        if k and k not in unique:
            unique.append(k)
    label = name or f"circulant({','.join(map(str, unique))})"
    return Graph(label, tuple(tuple((i + k) % n for k in unique) for i in range(n)))


def _van_der_corput(k: int, base: int) -> float:
    """The ``k``-th element of the van der Corput sequence in ``base``."""
    value, denominator = 0.0, 1.0
    while k:
        k, digit = divmod(k, base)
        denominator *= base
        value += digit / denominator
    return value


def halton(n: int, degree: int, base: int = 2) -> Graph:
    """Circulant whose offsets follow the van der Corput (Halton) sequence:
    ``n/2, n/4, 3n/4, ...`` in base 2 -- spread over the ring, as in ASAP's
    Halton graphs. At sizes where these offsets share a factor with ``n`` the
    graph is disconnected or nearly bipartite, which its spectral gap shows."""
    offsets: list[int] = []
    k = 1
    while len(offsets) < min(degree, n - 1) and k < 64 * n:
        offset = round(n * _van_der_corput(k, base)) % n
        if offset and offset not in offsets:
            offsets.append(offset)
        k += 1
    return circulant(n, offsets, name=f"halton{base}({','.join(map(str, offsets))})")


def exponential(n: int, degree: int) -> Graph:
    """``i -> i + 2^k`` for ``k < degree``: logarithmic diameter at small degree."""
    offsets = [2**k for k in range(degree) if 2**k < n]
    return circulant(n, offsets, name=f"exponential({','.join(map(str, offsets))})")


def random_regular(n: int, degree: int, seed: int = 0) -> Graph:
    """Union of ``degree`` random derangements: a random ``degree``-regular
    digraph without self-loops or repeated edges (rejection sampled)."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in range(n)]
    for _ in range(min(degree, n - 1)):
        for _attempt in range(1000):
            perm = rng.permutation(n)
            if all(perm[i] != i and perm[i] not in out[i] for i in range(n)):
                break
        else:
            raise ValueError(f"no random {degree}-regular digraph on {n} nodes found")
        for i in range(n):
            out[i].append(int(perm[i]))
    return Graph(f"random-regular(d={degree},seed={seed})", tuple(tuple(p) for p in out))


def candidates(n: int, max_degree: int, seeds: Sequence[int] = range(8)) -> list[Graph]:
    """Every sparse construction with out-degree at most ``max_degree``."""
    graphs: list[Graph] = []
    for d in range(1, min(max_degree, n - 1) + 1):
        graphs += [halton(n, d, 2), halton(n, d, 3), exponential(n, d)]
        graphs += [random_regular(n, d, seed) for seed in seeds]
    graphs += [circulant(n, [k]) for k in range(2, n) if math.gcd(k, n) == 1]
    return [g for g in graphs if g.degree <= max_degree]


def choose_graph(n: int, max_degree: int, seeds: Sequence[int] = range(8)) -> Graph:
    """The candidate with the largest spectral gap (then the smallest degree,
    then the smallest diameter) whose out-degree is at most ``max_degree``."""
    if n < 2:
        return Graph("single", ((),))
    if max_degree >= n - 1:
        return all_to_all(n)
    pool = candidates(n, max_degree, seeds)
    best = max(pool, key=lambda g: (round(g.spectral_gap, 9), -g.degree, -g.diameter))
    logger.debug("chose %s (gap %.3f, diameter %s) among %d candidates",
                 best.name, best.spectral_gap, best.diameter, len(pool))
    return best
