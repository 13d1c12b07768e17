"""A link: the parcelport's record of one device and what rides on it.

The device moves bytes; the link knows who is at the other end (from the
greeting), which virtual connections are open on it, and where in its life
it is. Its states form an explicit table, as h11's ``_state.py`` does: every
change goes through :meth:`Link.advance`, and an event a state does not
accept is a protocol violation, never a silent no-op.

``GREETING``  the device is connected; nothing but HELLO may arrive.
``OPEN``      greeted: virtual connections open, carry parcels and close.
``CLOSING``   our output is ending; parcels of the peer may still arrive for
              the virtual connections that remain, until its end or the linger.
``LOST``      the device is gone; nothing more happens on this link.
"""

from __future__ import annotations

import asyncio
import enum
import json
from dataclasses import dataclass
from typing import Any, Protocol

from dask_lcicomm.parcel import Close, Connect, Hello, Limits, Message
from dask_lcicomm.providers.base import Device


class State(enum.Enum):
    GREETING = "greeting"
    OPEN = "open"
    CLOSING = "closing"
    LOST = "lost"


class Step(enum.Enum):
    GREETED = "greeted"
    FINISH = "finish"
    LOSE = "lose"


_TRANSITIONS: dict[tuple[State, Step], State] = {
    (State.GREETING, Step.GREETED): State.OPEN,
    (State.GREETING, Step.FINISH): State.CLOSING,
    (State.OPEN, Step.FINISH): State.CLOSING,
    (State.GREETING, Step.LOSE): State.LOST,
    (State.OPEN, Step.LOSE): State.LOST,
    (State.CLOSING, Step.LOSE): State.LOST,
}

#: The wire events each state accepts.
ACCEPTS: dict[State, tuple[type, ...]] = {
    State.GREETING: (Hello,),
    State.OPEN: (Connect, Close, Message),
    State.CLOSING: (Connect, Close, Message),
    State.LOST: (),
}


class LinkError(RuntimeError):
    """A state change the table does not allow."""


class Receiver(Protocol):
    """What the parcelport delivers a virtual connection's traffic to."""

    def deliver(self, frames: list[memoryview]) -> None: ...

    def peer_closed(self, reason: str) -> None: ...


class Owner(Protocol):
    """Who opened a link and wants to know what becomes of it (a channel)."""

    def link_idle(self, link: Link) -> None:
        """A virtual connection on ``link`` closed."""

    def link_lost(self, link: Link) -> None:
        """``link`` is gone."""

    def retire(self) -> None:
        """The peer refused a virtual connection: open no more."""


@dataclass(frozen=True)
class Greeting:
    """What a parcelport tells its peer in HELLO (JSON, bounded by the codec)."""

    pid: int | None
    host: str | None
    #: What the sender may make us allocate: a peer sends within these.
    limits: Limits
    #: Provider name -> what a peer needs to connect to it (listeners only).
    offers: dict[str, Any]

    def encode(self) -> bytes:
        limits = self.limits
        return json.dumps({
            "pid": self.pid,
            "host": self.host,
            "limits": {
                "max_message_bytes": limits.max_message_bytes,
                "max_frames": limits.max_frames,
                "max_eager_bytes": limits.max_eager_bytes,
            },
            "offers": self.offers,
        }).encode()

    @classmethod
    def decode(cls, payload: bytes) -> Greeting:
        """Parse and check a peer's greeting; ``ValueError`` if malformed."""
        info = json.loads(payload)
        if not isinstance(info, dict):
            raise ValueError("not an object")
        limits = info.get("limits")
        if not isinstance(limits, dict):
            raise ValueError("no limits")
        values = {}
        for key in ("max_message_bytes", "max_frames", "max_eager_bytes"):
            value = limits.get(key)
            if type(value) is not int or value < 1:
                raise ValueError(f"limit {key} must be a positive integer, got {value!r}")
            values[key] = value
        offers = info.get("offers", {})
        if not isinstance(offers, dict):
            raise ValueError("offers must be an object")
        pid, host = info.get("pid"), info.get("host")
        return cls(
            pid if type(pid) is int else None,
            host if isinstance(host, str) else None,
            Limits(**values),
            offers,
        )


class Link:
    """One device of the parcelport, its peer and its virtual connections."""

    def __init__(
        self,
        device: Device,
        index: int,
        hello: bytes,
        acceptor: object | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.device = device
        #: Which of a channel's replicated devices this is.
        self.index = index
        #: Our greeting to the peer: sent first when we connect, in reply when we accept.
        self.hello = hello
        #: The accepting side: the listener's registration (opaque here).
        self.acceptor = acceptor
        #: The connecting side: whoever opened the link.
        self.owner: Owner | None = None
        self.state = State.GREETING
        self.peer: Greeting | None = None
        self.vcs: dict[int, Receiver] = {}
        #: Done when the peer's greeting arrived; fails if the link is lost first.
        self.greeted: asyncio.Future[None] = loop.create_future()
        # Nobody may be waiting when the link is lost: never report "exception
        # never retrieved" for it.
        self.greeted.add_done_callback(lambda f: f.cancelled() or f.exception())
        #: The greeting deadline, then the linger of a closing link.
        self.timer: asyncio.TimerHandle | None = None

    def advance(self, step: Step) -> State:
        """Take ``step``; :class:`LinkError` if the table does not allow it."""
        try:
            self.state = _TRANSITIONS[self.state, step]
        except KeyError:
            raise LinkError(f"{step.value} in state {self.state.value}") from None
        return self.state

    def accepts(self, event: object) -> bool:
        """Whether ``event`` from the wire is valid in the current state."""
        return isinstance(event, ACCEPTS[self.state])

    @property
    def open(self) -> bool:
        return self.state is State.OPEN

    @property
    def peer_limits(self) -> Limits:
        assert self.peer is not None, "limits are known once greeted"
        return self.peer.limits

    def describe(self) -> dict[str, Any]:
        """For diagnostics and a comm's ``extra_info``."""
        peer = self.peer
        return {
            "provider": self.device.provider,
            "device": self.index,
            "state": self.state.value,
            "local_address": self.device.local_address,
            "peer_address": self.device.peer_address,
            "peer_pid": peer.pid if peer else None,
            "peer_host": peer.host if peer else None,
            "comms": len(self.vcs),
        }
