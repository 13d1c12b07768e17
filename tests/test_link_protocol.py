"""The link protocol on its own: every state, step and wire event, without
sockets, event loops or devices."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dask_lcicomm.link_protocol import (
    _TRANSITIONS,
    ACCEPTS,
    Accepted,
    Greeted,
    Greeting,
    LinkError,
    LinkProtocol,
    Lost,
    Opened,
    Refused,
    Send,
    State,
    Step,
    Violation,
)
from dask_lcicomm.parcel import Close, Connect, Hello, Limits, Message, ParcelDecoder

LIMITS = Limits(1 << 30, 1000, 1 << 20)


class Listener:
    def __init__(self, active: bool = True) -> None:
        self.active = active


class Receiver:
    def __init__(self) -> None:
        self.delivered: list[list[memoryview]] = []
        self.closed: list[str] = []

    def deliver(self, frames: list[memoryview]) -> None:
        self.delivered.append(frames)

    def peer_closed(self, reason: str) -> None:
        self.closed.append(reason)


def _greeting(**offers) -> Greeting:
    return Greeting(42, "node1", LIMITS, offers)


def _hello(greeting: Greeting | None = None) -> Hello:
    return Hello((greeting or _greeting()).encode())


def _connecting(state: State = State.GREETING) -> LinkProtocol:
    link = LinkProtocol(_greeting(), None)
    link.state = state
    return link


def _accepting(state: State = State.GREETING, active: bool = True) -> LinkProtocol:
    link = LinkProtocol(_greeting(shm="name"), Listener(active))
    link.state = state
    return link


def _decoded(send: Send, require_connect: bool = False) -> list:
    """What the peer's decoder makes of a control parcel."""
    return ParcelDecoder(LIMITS, require_connect=require_connect).feed(send.data)


EXPECTED = {
    (State.GREETING, Step.GREETED): State.OPEN,
    (State.GREETING, Step.FINISH): State.CLOSING,
    (State.OPEN, Step.FINISH): State.CLOSING,
    (State.GREETING, Step.LOSE): State.LOST,
    (State.OPEN, Step.LOSE): State.LOST,
    (State.CLOSING, Step.LOSE): State.LOST,
}


@pytest.mark.parametrize(("state", "step"), list(itertools.product(State, Step)))
def test_every_state_and_step(state, step):
    link = _connecting(state)
    if (state, step) in EXPECTED:
        assert link.advance(step) is EXPECTED[state, step]
    else:
        with pytest.raises(LinkError, match=f"{step.value} in state {state.value}"):
            link.advance(step)
        assert link.state is state


def test_the_table_is_the_one_documented():
    assert _TRANSITIONS == EXPECTED
    assert set(ACCEPTS) == set(State)


EVENTS = [Hello(b"{}"), Connect(1), Close(1), Message(1, 0, [])]


@pytest.mark.parametrize("accepting", [False, True])
@pytest.mark.parametrize("state", list(State))
def test_which_wire_events_each_state_accepts(state, accepting):
    """An event a state does not accept is a violation, except on a lost link,
    which drops whatever still arrives."""
    for event in EVENTS:
        link = _accepting(state) if accepting else _connecting(state)
        effects = link.receive(event)
        violated = any(isinstance(e, Violation) and " in state " in e.reason for e in effects)
        allowed = {
            State.GREETING: {"Hello"},
            State.OPEN: {"Connect", "Close", "Message"},
            State.CLOSING: {"Connect", "Close", "Message"},
            State.LOST: {"Hello", "Connect", "Close", "Message"},
        }[state]
        assert violated is (type(event).__name__ not in allowed), (state, event)
        if state is State.LOST:
            assert effects == ()


# -- greeting -------------------------------------------------------------------


def test_the_connecting_side_greets_first_and_opens_on_the_answer():
    link = _connecting()
    hello = link.greet()
    [event] = _decoded(hello)
    assert hello.vc == 0 and Greeting.decode(event.payload) == _greeting()
    peer = _greeting(shm={"name": "x"})
    assert link.receive(_hello(peer)) == (Greeted(),)
    assert link.state is State.OPEN and link.peer == peer and link.peer_limits == LIMITS


def test_the_accepting_side_answers_the_greeting_with_its_own():
    link = _accepting()
    effects = link.receive(_hello())
    assert effects == (Send(0, link.hello), Greeted())
    [event] = _decoded(effects[0])
    assert Greeting.decode(event.payload).offers == {"shm": "name"}
    assert link.open


@pytest.mark.parametrize("accepting", [False, True])
def test_a_malformed_greeting_is_a_violation_and_changes_nothing(accepting):
    link = _accepting() if accepting else _connecting()
    [effect] = link.receive(Hello(b"[]"))
    assert isinstance(effect, Violation) and "malformed HELLO: not an object" in effect.reason
    assert link.state is State.GREETING and link.peer is None


def test_a_second_greeting_is_a_violation():
    link = _connecting(State.OPEN)
    [effect] = link.receive(_hello())
    assert effect == Violation("Hello in state open")


def test_only_the_connecting_side_in_greeting_greets_first():
    with pytest.raises(AssertionError):
        _accepting().greet()
    with pytest.raises(AssertionError):
        _connecting(State.OPEN).greet()


# -- virtual connections we open ----------------------------------------------------


def test_a_virtual_connection_we_open_is_opened_by_the_peers_connect():
    link = _connecting(State.OPEN)
    receiver = Receiver()
    send = link.open_vc(3, receiver)
    assert send.vc == 3 and _decoded(send, require_connect=True) == [Connect(3)]
    assert link.receive(Connect(3)) == (Opened(3),)
    frames = [memoryview(b"x")]
    assert link.receive(Message(3, 0, frames)) == ()
    assert receiver.delivered == [frames]
    # Answered once: another CONNECT is forged.
    assert link.receive(Connect(3)) == (Violation("unexpected CONNECT for vc 3"),)


def test_a_connect_for_a_virtual_connection_we_never_opened_is_a_violation():
    assert _connecting(State.OPEN).receive(Connect(9)) == (Violation("unexpected CONNECT for vc 9"),)


def test_a_refused_virtual_connection_tells_its_receiver_and_the_link():
    link = _connecting(State.OPEN)
    receiver = Receiver()
    link.open_vc(1, receiver)
    assert link.receive(Close(1)) == (Refused(1),)
    assert receiver.closed == ["closed by peer"]


def test_the_peer_closing_an_opened_virtual_connection_is_no_refusal():
    link = _connecting(State.OPEN)
    receiver = Receiver()
    link.open_vc(1, receiver)
    link.receive(Connect(1))
    assert link.receive(Close(1)) == ()
    assert receiver.closed == ["closed by peer"]


@pytest.mark.parametrize("state", [State.GREETING, State.CLOSING, State.LOST])
def test_virtual_connections_open_only_on_an_open_link(state):
    with pytest.raises(LinkError, match=f"state {state.value}"):
        _connecting(state).open_vc(1, Receiver())


def test_the_accepting_side_never_opens_and_an_id_is_never_reused():
    with pytest.raises(LinkError):
        _accepting(State.OPEN).open_vc(1, Receiver())
    link = _connecting(State.OPEN)
    link.open_vc(1, Receiver())
    with pytest.raises(LinkError, match="vc 1 is open"):
        link.open_vc(1, Receiver())


# -- virtual connections the peer opens ---------------------------------------------


def test_the_accepting_side_accepts_while_its_listener_is_active():
    link = _accepting(State.OPEN)
    effects = link.receive(Connect(5))
    assert effects == (Send(5, effects[0].data), Accepted(5))
    assert _decoded(effects[0]) == [Connect(5)]
    receiver = Receiver()
    link.attach(5, receiver)
    assert link.receive(Message(5, 0, [])) == ()
    assert receiver.delivered == [[]]
    assert link.receive(Connect(5)) == (Violation("CONNECT for vc 5, which is open"),)


@pytest.mark.parametrize(("state", "active"), [(State.OPEN, False), (State.CLOSING, True)])
def test_a_stopped_listener_or_a_closing_link_refuses_with_close(state, active):
    link = _accepting(state, active)
    [effect] = link.receive(Connect(5))
    assert isinstance(effect, Send) and _decoded(effect) == [Close(5)]
    assert link.vcs == {}


# -- closing ------------------------------------------------------------------------


def test_closing_our_end_sends_close_once_and_drops_later_traffic():
    link = _accepting(State.OPEN)
    link.receive(Connect(2))
    receiver = Receiver()
    link.attach(2, receiver)
    send = link.close_vc(2, receiver)
    assert send is not None and _decoded(send) == [Close(2)]
    assert link.close_vc(2, receiver) is None
    assert link.receive(Message(2, 0, [memoryview(b"late")])) == ()
    assert link.receive(Close(2)) == ()
    assert receiver.delivered == [] and receiver.closed == []


def test_only_the_receiver_that_holds_a_virtual_connection_closes_it():
    link = _connecting(State.OPEN)
    holder = Receiver()
    link.open_vc(1, holder)
    assert link.close_vc(1, Receiver()) is None
    assert link.vcs == {1: holder}


def test_finish_ends_the_output_once_and_the_peer_may_still_send():
    link = _connecting(State.OPEN)
    receiver = Receiver()
    link.open_vc(1, receiver)
    link.receive(Connect(1))
    assert link.finish() is True and link.state is State.CLOSING
    assert link.finish() is False
    assert link.receive(Message(1, 0, [])) == () and receiver.delivered == [[]]


# -- loss ---------------------------------------------------------------------------


def test_losing_the_link_tells_every_receiver_once_and_names_what_was_opening():
    link = _connecting(State.OPEN)
    opened, opening = Receiver(), Receiver()
    link.open_vc(1, opened)
    link.receive(Connect(1))
    link.open_vc(2, opening)
    assert link.lose("gone", violation=False) == Lost(False, [2])
    assert opened.closed == opening.closed == ["gone"]
    assert link.state is State.LOST and link.vcs == {}
    assert link.lose("again", violation=True) is None
    assert opened.closed == ["gone"]
    assert link.finish() is False


@pytest.mark.parametrize(
    ("state", "violation", "not_a_peer"),
    [
        (State.GREETING, True, True),
        (State.GREETING, False, False),
        (State.OPEN, True, False),
        (State.CLOSING, True, False),
    ],
)
def test_a_violation_while_greeting_means_the_peer_does_not_speak_the_protocol(
    state, violation, not_a_peer
):
    lost = _connecting(state).lose("x", violation)
    assert lost is not None and lost.not_a_peer is not_a_peer


# -- any sequence -------------------------------------------------------------------

wire_events = st.one_of(
    st.builds(Hello, st.sampled_from([_greeting().encode(), b"{}", b"junk"])),
    st.builds(Connect, st.integers(0, 3)),
    st.builds(Close, st.integers(0, 3)),
    st.builds(Message, st.integers(0, 3), st.just(0), st.just([])),
)
local_steps = st.one_of(
    st.tuples(st.just("open"), st.integers(1, 3)),
    st.tuples(st.just("close"), st.integers(0, 3)),
    st.just(("finish", 0)),
    st.just(("lose", 0)),
)


@given(
    accepting=st.booleans(),
    active=st.booleans(),
    steps=st.lists(st.one_of(wire_events, local_steps), max_size=30),
)
def test_any_sequence_moves_along_the_table_and_tells_each_receiver_of_its_end_once(
    accepting, active, steps
):
    link = _accepting(active=active) if accepting else _connecting()
    receivers: dict[int, Receiver] = {}
    for step in steps:
        before = link.state
        if isinstance(step, tuple):
            action, vc = step
            if action == "open":
                try:
                    link.open_vc(vc, receivers.setdefault(vc, Receiver()))
                except LinkError:
                    assert accepting or link.state is not State.OPEN or vc in link.vcs
            elif action == "close" and vc in link.vcs:
                assert link.close_vc(vc, link.vcs[vc]) is not None
            elif action == "finish":
                link.finish()
            elif action == "lose":
                link.lose("lost", violation=False)
        else:
            for effect in link.receive(step):
                if isinstance(effect, Accepted):
                    link.attach(effect.vc, receivers.setdefault(effect.vc, Receiver()))
                if isinstance(effect, (Opened, Refused, Accepted)):
                    assert link.state in (State.OPEN, State.CLOSING)
        assert before is link.state or (before, link.state) in {
            (a, _TRANSITIONS[a, s]) for a, s in _TRANSITIONS
        }
        assert link.state is not State.LOST or link.vcs == {}
    for receiver in receivers.values():
        assert receiver.closed.count("lost") <= 1


# -- the greeting's payload ----------------------------------------------------------


def test_greeting_round_trip():
    greeting = Greeting(42, "node1", Limits(1 << 30, 1000, 1 << 20), {"shm": "name"})
    assert Greeting.decode(greeting.encode()) == greeting


def _payload(**changes):
    info = {
        "pid": 1, "host": "h",
        "limits": {"max_message_bytes": 10, "max_frames": 10, "max_eager_bytes": 10},
        "offers": {},
    }
    info.update(changes)
    return json.dumps(info).encode()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"not json", "Expecting value"),
        (b"[]", "not an object"),
        (_payload(limits=None), "no limits"),
        (_payload(limits={"max_message_bytes": 10, "max_frames": 10}), "max_eager_bytes"),
        (_payload(limits={"max_message_bytes": 0, "max_frames": 1, "max_eager_bytes": 1}), "positive"),
        (_payload(limits={"max_message_bytes": 1.5, "max_frames": 1, "max_eager_bytes": 1}), "integer"),
        (_payload(limits={"max_message_bytes": True, "max_frames": 1, "max_eager_bytes": 1}), "integer"),
        (_payload(offers=[]), "offers"),
    ],
)
def test_malformed_greetings_are_refused(payload, match):
    with pytest.raises(ValueError, match=match):
        Greeting.decode(payload)


def test_identity_of_odd_types_is_dropped_not_trusted():
    greeting = Greeting.decode(_payload(pid="1", host=5))
    assert greeting.pid is None and greeting.host is None
