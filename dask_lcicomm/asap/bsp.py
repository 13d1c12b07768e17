"""BSP averaging: every worker sends its model to every other one each round
and reduces once all of that round's models are in.

This is the all-reduce of the paper and of MALT. The exchange is the
barrier: no worker can reduce round ``r`` before every worker has finished
its step of round ``r``, so a separate barrier message would only add a
round trip. Models of a later round that arrive early are kept by round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dask_lcicomm.asap.protocol import Action, Kind, Message, Reduced, Send
from dask_lcicomm.asap.reduce import average


class AllToAll:
    """One worker's side of the all-to-all exchange among ``peers``."""

    def __init__(self, peers: Sequence[int]) -> None:
        self.peers = tuple(peers)
        self.round = 0
        self._model: np.ndarray | None = None
        self._models: dict[int, dict[int, np.ndarray]] = {}  # round -> src -> model

    def start_round(self, round: int, model: np.ndarray) -> list[Action]:
        if round != self.round or self._model is not None:
            raise RuntimeError(f"start_round({round}) while round {self.round} is pending")
        self._model = model
        notify = Message(Kind.NOTIFY, round, model)
        return [Send(dst, notify) for dst in self.peers] + self._try_reduce()

    def receive(self, src: int, message: Message) -> list[Action]:
        if message.kind is not Kind.NOTIFY or src not in self.peers or message.round < self.round:
            raise RuntimeError(f"unexpected {message.kind.value}({message.round}) from {src}")
        self._models.setdefault(message.round, {})[src] = message.model
        return self._try_reduce()

    def _try_reduce(self) -> list[Action]:
        arrived = self._models.get(self.round, {})
        if self._model is None or len(arrived) < len(self.peers):
            return []
        self._models.pop(self.round, None)
        reduced = Reduced(self.round, average(self._model, [arrived[p] for p in self.peers]))
        self.round += 1
        self._model = None
        return [reduced]
