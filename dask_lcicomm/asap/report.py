"""What a run measured, per worker and for the whole cluster.

A worker's curve has a point per recorded round: time since the common
start, rounds completed, bytes it had sent, and the loss of its own model.
The cluster's curve at time ``t`` is the mean, over workers, of each one's
latest loss, and the sum of their bytes: the loss a user would get from a
worker picked at random, and what the network carried to get there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    address: str
    rounds: int
    elapsed_s: float
    bytes_sent: int
    messages_sent: int
    dropped: int  # async: models replaced by a newer one before they left
    wait_s: float  # blocked in the exchange
    step_s: float  # computing (including emulated compute time)
    max_staleness: int  # largest round difference inside one reduce
    timed_out: bool
    start_lag_s: float
    reduces: list[tuple[float, int, int]]  # (t, rounds completed, bytes sent)
    curve: list[tuple[float, int, int, float]]  # (t, round, bytes sent, loss)
    final_loss: float
    final_accuracy: float

    @classmethod
    def from_dict(cls, address: str, raw: dict[str, Any]) -> WorkerReport:
        return cls(address=address, **raw)


@dataclass(frozen=True)
class Point:
    t: float
    loss: float  # mean of the workers' latest losses
    bytes: int  # total bytes sent by all workers
    rounds: float  # mean rounds completed


@dataclass
class RunReport:
    mode: str
    graph: str
    spectral_gap: float  # of one round's reduce (1 for the all-reduces)
    diameter: float  # of the graph the mode exchanges on
    workers: list[WorkerReport]

    def curve(self) -> list[Point]:
        """The cluster's curve, a point whenever any worker recorded one."""
        events = sorted((t, w.rank, rounds, sent, loss)
                        for w in self.workers for t, rounds, sent, loss in w.curve)
        latest: dict[int, tuple[int, int, float]] = {}
        points = []
        for t, rank, rounds, sent, loss in events:
            latest[rank] = (rounds, sent, loss)
            if len(latest) == len(self.workers):
                values = list(latest.values())
                points.append(Point(t, float(np.mean([v[2] for v in values])),
                                    int(sum(v[1] for v in values)),
                                    float(np.mean([v[0] for v in values]))))
        return points

    def first_below(self, target: float) -> Point | None:
        return next((p for p in self.curve() if p.loss <= target), None)

    def iteration_gaps(self) -> list[int]:
        """Per worker (by rank), the most rounds it was ever ahead of the
        slowest or behind the fastest worker (from the reduce timestamps, all
        on one clock)."""
        events = sorted((t, w.rank, rounds) for w in self.workers for t, rounds, _ in w.reduces)
        current = [0] * len(self.workers)
        gaps = [0] * len(self.workers)
        for _, rank, rounds in events:
            current[rank] = rounds
            hi, lo = max(current), min(current)
            gaps = [max(g, hi - c, c - lo) for g, c in zip(gaps, current, strict=True)]
        return gaps

    def max_iteration_gap(self) -> int:
        """Largest spread of completed rounds between any two workers at any instant."""
        return max(self.iteration_gaps(), default=0)

    @property
    def final_loss(self) -> float:
        return float(np.mean([w.final_loss for w in self.workers]))

    @property
    def final_accuracy(self) -> float:
        return float(np.mean([w.final_accuracy for w in self.workers]))

    @property
    def bytes_sent(self) -> int:
        return sum(w.bytes_sent for w in self.workers)

    @property
    def wait_s(self) -> float:
        """Mean seconds a worker spent blocked in the exchange."""
        return float(np.mean([w.wait_s for w in self.workers]))
