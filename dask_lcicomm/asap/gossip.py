"""Plain asynchronous averaging: send, never wait, reduce whatever arrived.

Each round a worker sends its model to its out-neighbours and at once
averages its own with the models that arrived since its last reduce (the
newest one per sender). Nothing bounds how far workers drift apart, and the
weights change with what happened to arrive, so the average is not
preserved: the accuracy cost ASAP is meant to avoid.

Sends are marked ``latest_only``: a model still queued for a peer when the
next one is ready is replaced, so a slow link carries the newest model
instead of a growing backlog (the most favourable async there is).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dask_lcicomm.asap.protocol import Action, Kind, Message, Reduced, Send
from dask_lcicomm.asap.reduce import average


class Gossip:
    """One worker's side of asynchronous averaging."""

    def __init__(self, out_peers: Sequence[int], in_peers: Sequence[int]) -> None:
        self.out_peers = tuple(out_peers)
        self.in_peers = tuple(in_peers)
        self._inbox: dict[int, Message] = {}  # src -> newest unreduced model

    def start_round(self, round: int, model: np.ndarray) -> list[Action]:
        notify = Message(Kind.NOTIFY, round, model)
        actions: list[Action] = [Send(dst, notify, latest_only=True) for dst in self.out_peers]
        arrived = [self._inbox.pop(src) for src in self.in_peers if src in self._inbox]
        staleness = max((abs(round - m.round) for m in arrived), default=0)
        actions.append(Reduced(round, average(model, [m.model for m in arrived]), staleness))
        return actions

    def receive(self, src: int, message: Message) -> list[Action]:
        if message.kind is not Kind.NOTIFY or src not in self.in_peers:
            raise RuntimeError(f"unexpected {message.kind.value} from {src}")
        held = self._inbox.get(src)
        if held is None or held.round < message.round:
            self._inbox[src] = message
        return []
