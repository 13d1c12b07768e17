"""How long a local step takes on an emulated cluster, slowdowns included.

On a shared cluster a worker is now and then several times slower (another
job, a noisy neighbour). :class:`Pacing` pads each real step up to
``compute_s`` -- so that eight emulated hosts on a two-core machine behave as
eight hosts with a core each -- and multiplies it by ``factor`` for the slow
worker: in ``transient`` mode one worker per round chosen at random (the same
one in every mode, from ``seed``), or always rank ``straggler``. A worker
that is always slow paces every mode that bounds staleness, so it is a case
of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pacing:
    compute_s: float = 0.0
    factor: float = 1.0
    transient: bool = False
    straggler: int | None = None
    seed: int = 0

    def slow(self, rank: int, round: int, nworkers: int) -> bool:
        if self.straggler is not None and rank == self.straggler:
            return True
        return self.transient and int(np.random.default_rng([self.seed, round]).integers(nworkers)) == rank

    def duration(self, rank: int, round: int, nworkers: int) -> float:
        """Seconds the step of ``round`` on ``rank`` should last at least."""
        return self.compute_s * (self.factor if self.slow(rank, round, nworkers) else 1.0)
