"""The parcelport's record of a link, beside its protocol."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dask_lcicomm.link import Link
from dask_lcicomm.link_protocol import Greeting, LinkProtocol
from dask_lcicomm.parcel import Limits


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
    protocol = LinkProtocol(Greeting(1, "h", Limits(), {}), None)
    return Link(_Device(), 0, protocol, loop)  # type: ignore[arg-type]


def test_a_lost_greeting_nobody_awaits_is_not_reported(loop, caplog):
    link = _link(loop)
    link.greeted.set_exception(ConnectionResetError("lost"))
    loop.run_until_complete(asyncio.sleep(0))
    del link
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_the_record_describes_its_device_and_protocol(loop):
    link = _link(loop)
    link.timer = loop.call_later(60, lambda: None)
    link.cancel_timer()
    assert link.timer is None
    assert link.describe() == {
        "provider": "fake", "device": 0, "state": "greeting",
        "local_address": "lci://a:1", "peer_address": "lci://b:2",
        "peer_pid": None, "peer_host": None, "comms": 0,
    }
