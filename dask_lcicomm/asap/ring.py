"""Ring all-reduce: the bandwidth-optimal BSP baseline.

The model is cut into ``n`` chunks. In ``n-1`` reduce-scatter steps each
worker passes a chunk to its successor and adds the one from its
predecessor, so that it ends up owning the full sum of one chunk; in ``n-1``
all-gather steps the summed chunks travel once around the ring. Each worker
sends ``2(n-1)/n`` models per round, fewer bytes than any averaging graph of
degree 2 or more, but every step waits for the predecessor: the ring is as
slow as its slowest worker, every round.
"""

from __future__ import annotations

import numpy as np

from dask_lcicomm.asap.protocol import Action, Kind, Message, Reduced, Send


class RingAllReduce:
    """One worker's side of the ring all-reduce among ``n`` ranks."""

    def __init__(self, rank: int, n: int) -> None:
        self.rank, self.n = rank, n
        self.round = 0
        self._step = 0  # the next step whose chunk this worker awaits
        self._acc: np.ndarray | None = None  # own model, reduced in place; None between rounds
        self._bounds: np.ndarray  # chunk i is [bounds[i], bounds[i + 1]), set by start_round
        self._early: dict[tuple[int, int], np.ndarray] = {}  # (round, step) -> chunk

    def _chunk(self, index: int) -> slice:
        return slice(self._bounds[index % self.n], self._bounds[index % self.n + 1])

    def _send(self, acc: np.ndarray, step: int) -> Send:
        """Step ``s < n-1`` sends chunk ``rank - s`` (partial sums), later steps
        send chunk ``rank + 1 - (s - (n-1))`` (complete sums)."""
        index = self.rank - step if step < self.n - 1 else self.rank + 1 - (step - self.n + 1)
        data = acc[self._chunk(index)].copy()
        return Send((self.rank + 1) % self.n, Message(Kind.CHUNK, self.round, data, step))

    def start_round(self, round: int, model: np.ndarray) -> list[Action]:
        if round != self.round or self._acc is not None:
            raise RuntimeError(f"start_round({round}) while round {self.round} is pending")
        acc = self._acc = np.array(model, dtype=np.float64, copy=True)
        self._bounds = np.linspace(0, acc.size, self.n + 1).astype(int)
        if self.n == 1:
            return self._finish(acc)
        self._step = 0
        return [self._send(acc, 0), *self._drain(acc)]

    def receive(self, src: int, message: Message) -> list[Action]:
        if message.kind is not Kind.CHUNK or src != (self.rank - 1) % self.n:
            raise RuntimeError(f"unexpected {message.kind.value} from {src}")
        key = (message.round, message.step)
        if key in self._early or message.round < self.round:
            raise RuntimeError(f"duplicate or stale chunk {key} from {src}")
        self._early[key] = message.model
        return self._drain(self._acc) if self._acc is not None else []

    def _drain(self, acc: np.ndarray) -> list[Action]:
        actions: list[Action] = []
        while (self.round, self._step) in self._early:
            data = self._early.pop((self.round, self._step))
            s = self._step
            if s < self.n - 1:
                acc[self._chunk(self.rank - s - 1)] += data
            else:
                acc[self._chunk(self.rank - (s - self.n + 1))] = data
            self._step += 1
            if self._step == 2 * (self.n - 1):
                return actions + self._finish(acc)
            actions.append(self._send(acc, self._step))
        return actions

    def _finish(self, acc: np.ndarray) -> list[Action]:
        reduced = Reduced(self.round, acc / self.n)
        self.round += 1
        self._acc = None
        return [reduced]
