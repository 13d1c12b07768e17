"""ASAP's stochastic reduce under NOTIFY-ACK flow control, as a pure state machine.

Per round ``r`` a worker

1. sends its freshly stepped model with NOTIFY(r) to every out-neighbour, but
   only once every out-neighbour has ACKed its NOTIFY(r-1) -- a receiver is
   never sent a model it has not consumed the previous one of, so nothing
   floods and no buffer grows;
2. reduces (averages its model with its in-neighbours') once NOTIFY(r) from
   every in-neighbour arrived and its own NOTIFY(r) is out;
3. ACKs each in-neighbour for round ``r``.

The worker then steps round ``r+1`` while its out-neighbours' ACKs for ``r``
are still on their way: that overlap, and waiting only for neighbours instead
of everybody, is what it saves over a barrier.

Why it cannot deadlock: if every worker completed round ``r-1``, every ACK of
``r-1`` is sent, so every NOTIFY(r) is sent and every round ``r`` completes.
Why staleness is bounded: across an edge ``i -> j``, ``i`` completing round
``r`` needs ``j``'s ACK of ``r-1``, and ``j`` completing ``r`` needs ``i``'s
NOTIFY(r); so neighbours are never more than one round apart, and two workers
never more than the graph's (undirected) diameter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dask_lcicomm.asap.protocol import Action, Kind, Message, Reduced, Send
from dask_lcicomm.asap.reduce import average

logger = logging.getLogger(__name__)


class NotifyAck:
    """One worker's NOTIFY-ACK exchange over fixed in- and out-neighbours."""

    def __init__(self, out_peers: Sequence[int], in_peers: Sequence[int]) -> None:
        self.out_peers = tuple(out_peers)
        self.in_peers = tuple(in_peers)
        self.round = 0  # the round whose reduce is pending
        self._model: np.ndarray | None = None  # own model of ``self.round``
        self._sent = False  # own NOTIFY(self.round) is out
        self._unacked: set[int] = set()  # out-peers yet to ACK the last NOTIFY
        self._notifies: dict[int, dict[int, np.ndarray]] = {}  # round -> src -> model

    def start_round(self, round: int, model: np.ndarray) -> list[Action]:
        if round != self.round or self._model is not None:
            raise RuntimeError(f"start_round({round}) while round {self.round} is pending")
        self._model = model
        return self._progress()

    def receive(self, src: int, message: Message) -> list[Action]:
        if message.kind is Kind.ACK:
            if src not in self._unacked or message.round != self.round - (not self._sent):
                raise RuntimeError(f"unexpected ACK({message.round}) from {src} in round {self.round}")
            self._unacked.discard(src)
        elif message.kind is Kind.NOTIFY:
            if src not in self.in_peers or message.round < self.round:
                raise RuntimeError(f"unexpected NOTIFY({message.round}) from {src} in round {self.round}")
            models = self._notifies.setdefault(message.round, {})
            if src in models:
                raise RuntimeError(f"second NOTIFY({message.round}) from {src}")
            models[src] = message.model
        else:
            raise RuntimeError(f"NOTIFY-ACK got a {message.kind.value} message")
        return self._progress()

    def _progress(self) -> list[Action]:
        model = self._model
        if model is None:  # the local step of this round is still running
            return []
        actions: list[Action] = []
        if not self._sent and not self._unacked:
            notify = Message(Kind.NOTIFY, self.round, model)
            actions += [Send(dst, notify) for dst in self.out_peers]
            self._unacked = set(self.out_peers)
            self._sent = True
        arrived = self._notifies.get(self.round, {})
        if self._sent and len(arrived) == len(self.in_peers):
            self._notifies.pop(self.round, None)
            reduced = average(model, [arrived[src] for src in self.in_peers])
            ack = Message(Kind.ACK, self.round)
            actions += [Send(src, ack) for src in self.in_peers]
            actions.append(Reduced(self.round, reduced))
            self.round += 1
            self._model = None
            self._sent = False
        return actions
