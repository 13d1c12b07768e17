"""The link's state table and the greeting, on their own."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json

import pytest

from dask_lcicomm.link import _TRANSITIONS, ACCEPTS, Greeting, Link, LinkError, State, Step
from dask_lcicomm.parcel import Close, Connect, Hello, Limits, Message


class _Device:
    provider = "fake"
    local_address = "lci://a:1"
    peer_address = "lci://b:2"


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _link(loop) -> Link:
    return Link(_Device(), 0, b"", None, loop)  # type: ignore[arg-type]


EXPECTED = {
    (State.GREETING, Step.GREETED): State.OPEN,
    (State.GREETING, Step.FINISH): State.CLOSING,
    (State.OPEN, Step.FINISH): State.CLOSING,
    (State.GREETING, Step.LOSE): State.LOST,
    (State.OPEN, Step.LOSE): State.LOST,
    (State.CLOSING, Step.LOSE): State.LOST,
}


@pytest.mark.parametrize(("state", "step"), list(itertools.product(State, Step)))
def test_every_state_and_step(loop, state, step):
    link = _link(loop)
    link.state = state
    if (state, step) in EXPECTED:
        assert link.advance(step) is EXPECTED[state, step]
    else:
        with pytest.raises(LinkError, match=f"{step.value} in state {state.value}"):
            link.advance(step)
        assert link.state is state


def test_the_table_is_the_one_documented():
    assert _TRANSITIONS == EXPECTED


EVENTS = [Hello(b"{}"), Connect(1), Close(1), Message(1, 0, [])]


@pytest.mark.parametrize("state", list(State))
def test_which_wire_events_each_state_accepts(loop, state):
    link = _link(loop)
    link.state = state
    accepted = {type(e).__name__ for e in EVENTS if link.accepts(e)}
    assert accepted == {
        State.GREETING: {"Hello"},
        State.OPEN: {"Connect", "Close", "Message"},
        State.CLOSING: {"Connect", "Close", "Message"},
        State.LOST: set(),
    }[state]
    assert set(ACCEPTS) == set(State)


def test_a_lost_greeting_nobody_awaits_is_not_reported(loop, caplog):
    link = _link(loop)
    link.greeted.set_exception(ConnectionResetError("lost"))
    loop.run_until_complete(asyncio.sleep(0))
    del link
    gc.collect()
    assert "never retrieved" not in caplog.text


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
