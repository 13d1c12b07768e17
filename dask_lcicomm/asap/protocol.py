"""What the exchange state machines take in and give out.

Each mode's exchange is a pure object per worker (no sockets, no clocks):
the driver feeds it the worker's model after a local step
(:meth:`Exchange.start_round`) and every message that arrives
(:meth:`Exchange.receive`); it answers with actions: messages to send and,
once a round's reduce is done, the reduced model. The Dask runtime and the
discrete-event simulator are two drivers of the same machines, so the
protocol is tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np


class Kind(str, Enum):
    """Message kinds; ``str`` so that they travel as plain strings."""

    NOTIFY = "notify"  # a model for round r (NOTIFY-ACK, bsp, async)
    ACK = "ack"  # the receiver has reduced the sender's round-r model
    CHUNK = "chunk"  # a piece of the model in a ring all-reduce step


@dataclass(frozen=True)
class Message:
    kind: Kind
    round: int
    data: np.ndarray | None = None
    step: int = 0

    @property
    def model(self) -> np.ndarray:
        """``data`` of a NOTIFY or CHUNK; a peer that sent none broke the protocol."""
        if self.data is None:
            raise RuntimeError(f"{self.kind.value}({self.round}) without a model")
        return self.data


@dataclass(frozen=True)
class Send:
    """Send ``message`` to rank ``dst``; ``latest_only``: an unsent older
    message to the same peer with this flag may be dropped for it."""

    dst: int
    message: Message
    latest_only: bool = False


@dataclass(frozen=True)
class Reduced:
    """Round ``round`` is complete; ``model`` is the worker's new model and
    ``staleness`` the largest round difference of the models it averaged."""

    round: int
    model: np.ndarray
    staleness: int = 0


Action = Send | Reduced


class Exchange(Protocol):
    """One worker's side of a mode's model exchange."""

    def start_round(self, round: int, model: np.ndarray) -> list[Action]:
        """The local step of ``round`` produced ``model``."""
        ...

    def receive(self, src: int, message: Message) -> list[Action]:
        """``message`` arrived from rank ``src``."""
        ...
