"""The link protocol: every state a link and its virtual connections pass
through, as a state machine without I/O (h11's ``_state.py`` is the model).

A link is one device between two parcelports. Its protocol takes what the
parcel decoder made of the peer's bytes (HELLO, CONNECT, CLOSE, messages)
and the local steps (open or close a virtual connection, finish, lose the
device), changes state, and answers with effects: control parcels to send
and what whoever waits on the link must learn. It knows no event loop, no
device and no timer, so every rule is tested without sockets.

Link states, changed only by :meth:`LinkProtocol.advance`:

``GREETING``  the device is connected; nothing but HELLO may arrive.
``OPEN``      greeted: virtual connections open, carry parcels and close.
``CLOSING``   our output is ending; parcels of the peer may still arrive for
              the virtual connections that remain, until its end.
``LOST``      the device is gone; whatever still arrives is dropped.

A wire event a state does not accept is a :class:`Violation`, never a silent
no-op. The connecting side opens virtual connections (CONNECT, answered by
CONNECT, or by CLOSE when the listener has stopped); the accepting side only
answers. Either side closes its end with CLOSE.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dask_lcicomm.parcel import (
    Close,
    Connect,
    Hello,
    Limits,
    Message,
    encode_close,
    encode_connect,
    encode_hello,
)
from dask_lcicomm.parcel.wire import Event


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

#: The wire events each state accepts (a lost link drops everything).
ACCEPTS: dict[State, tuple[type, ...]] = {
    State.GREETING: (Hello,),
    State.OPEN: (Connect, Close, Message),
    State.CLOSING: (Connect, Close, Message),
    State.LOST: (),
}

class LinkError(RuntimeError):
    """A state change the table does not allow."""


class Receiver(Protocol):
    """What a virtual connection's traffic is delivered to."""

    def deliver(self, frames: list[memoryview]) -> None: ...

    def peer_closed(self, reason: str) -> None: ...


class Acceptor(Protocol):
    """The accepting side's listener, as far as the protocol asks."""

    #: Whether new virtual connections are still taken.
    active: bool


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


# -- effects: what the protocol asks of whoever drives it -----------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Queue the control parcel ``data`` on virtual connection ``vc``. If the
    device is gone, the effects after it are void: its loss follows."""

    vc: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Greeted:
    """The peer's greeting arrived (in :attr:`LinkProtocol.peer`)."""


@dataclass(frozen=True, slots=True)
class Opened:
    """The peer accepted the virtual connection ``vc`` we opened."""

    vc: int


@dataclass(frozen=True, slots=True)
class Refused:
    """The peer refused the virtual connection ``vc`` we opened: its listener
    stopped, so no more should be opened on this link."""

    vc: int


@dataclass(frozen=True, slots=True)
class Accepted:
    """The peer opened ``vc`` and our listener takes it: attach a receiver."""

    vc: int


@dataclass(frozen=True, slots=True)
class Violation:
    """The peer broke the protocol: the link must go."""

    reason: str


Effect = Send | Greeted | Opened | Refused | Accepted | Violation


@dataclass(frozen=True, slots=True)
class Lost:
    """What a lost link leaves to settle."""

    #: Lost while greeting because the peer broke the protocol: it does not speak it.
    not_a_peer: bool
    #: The virtual connections we opened that the peer never answered.
    opening: list[int]


class LinkProtocol:
    """The state of one link and of the virtual connections on it."""

    def __init__(self, greeting: Greeting, acceptor: Acceptor | None) -> None:
        #: Our HELLO: sent first when we connect, in reply when we accept.
        self.hello = encode_hello(greeting.encode())
        #: The accepting side's listener; None on the connecting side.
        self.acceptor = acceptor
        self.state = State.GREETING
        #: The peer's greeting, once it arrived.
        self.peer: Greeting | None = None
        #: The open virtual connections, ours and the peer's.
        self.vcs: dict[int, Receiver] = {}
        self._opening: set[int] = set()

    def advance(self, step: Step) -> State:
        """Take ``step``; :class:`LinkError` if the table does not allow it."""
        try:
            self.state = _TRANSITIONS[self.state, step]
        except KeyError:
            raise LinkError(f"{step.value} in state {self.state.value}") from None
        return self.state

    @property
    def open(self) -> bool:
        return self.state is State.OPEN

    @property
    def peer_limits(self) -> Limits:
        assert self.peer is not None, "limits are known once greeted"
        return self.peer.limits

    # -- the peer's events -------------------------------------------------------

    def receive(self, event: Event) -> Sequence[Effect]:
        """Take one event of the peer's; the effects, in the order to apply."""
        if isinstance(event, Message):
            receiver = self.vcs.get(event.vc)
            if receiver is not None:
                receiver.deliver(event.frames)
                return ()
        state = self.state
        if state is State.LOST:
            return ()
        if not isinstance(event, ACCEPTS[state]):
            return (Violation(f"{type(event).__name__} in state {state.value}"),)
        if isinstance(event, Hello):
            return self._greeted(event.payload)
        if isinstance(event, Connect):
            return self._connect(event.vc)
        if isinstance(event, Close):
            return self._close(event.vc)
        # A message for a virtual connection closed on our side: nobody reads it.
        return ()

    def _greeted(self, payload: bytes) -> Sequence[Effect]:
        try:
            self.peer = Greeting.decode(payload)
        except ValueError as e:
            return (Violation(f"malformed HELLO: {e}"),)
        self.advance(Step.GREETED)
        if self.acceptor is not None:
            return (Send(0, self.hello), Greeted())
        return (Greeted(),)

    def _connect(self, vc: int) -> Sequence[Effect]:
        if self.acceptor is None:
            if vc not in self._opening:
                return (Violation(f"unexpected CONNECT for vc {vc}"),)
            self._opening.discard(vc)
            return (Opened(vc),)
        if vc in self.vcs:
            return (Violation(f"CONNECT for vc {vc}, which is open"),)
        if not (self.acceptor.active and self.state is State.OPEN):
            return (Send(vc, encode_close(vc)),)
        return (Send(vc, encode_connect(vc)), Accepted(vc))

    def _close(self, vc: int) -> Sequence[Effect]:
        receiver = self.vcs.get(vc)
        if receiver is None:
            # Closed on our side already: both ends closed at once.
            return ()
        receiver.peer_closed("closed by peer")
        if vc in self._opening:
            self._opening.discard(vc)
            return (Refused(vc),)
        return ()

    # -- local steps ------------------------------------------------------------

    def greet(self) -> Send:
        """The connecting side speaks first."""
        assert self.acceptor is None and self.state is State.GREETING
        return Send(0, self.hello)

    def open_vc(self, vc: int, receiver: Receiver) -> Send:
        """We open ``vc``; the peer answers with :class:`Opened` or :class:`Refused`."""
        if self.acceptor is not None or self.state is not State.OPEN:
            raise LinkError(f"cannot open a virtual connection in state {self.state.value}")
        if vc in self.vcs:
            raise LinkError(f"vc {vc} is open")
        self.vcs[vc] = receiver
        self._opening.add(vc)
        return Send(vc, encode_connect(vc))

    def attach(self, vc: int, receiver: Receiver) -> None:
        """``receiver`` takes the virtual connection the peer opened (:class:`Accepted`)."""
        self.vcs[vc] = receiver

    def close_vc(self, vc: int, receiver: Receiver) -> Send | None:
        """``receiver`` closed its end of ``vc``: the CLOSE to send, or None if
        the link has no such virtual connection any more (lost, or closed)."""
        if self.vcs.get(vc) is not receiver:
            return None
        del self.vcs[vc]
        self._opening.discard(vc)
        return Send(vc, encode_close(vc))

    def finish(self) -> bool:
        """Our output ends; False if it has ended already or the link is lost."""
        if self.state not in (State.GREETING, State.OPEN):
            return False
        self.advance(Step.FINISH)
        return True

    def lose(self, reason: str, violation: bool) -> Lost | None:
        """The device is gone: every receiver learns ``reason`` (once). None
        if the link was lost already."""
        state = self.state
        if state is State.LOST:
            return None
        self.advance(Step.LOSE)
        receivers, self.vcs = self.vcs, {}
        opening, self._opening = sorted(self._opening), set()
        for receiver in receivers.values():
            receiver.peer_closed(reason)
        return Lost(state is State.GREETING and violation, opening)
