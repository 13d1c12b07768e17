"""The fabric endpoint a process's peers share, on every message fabric:
routes keep peers apart, hellos are checked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import pytest
from distributed.utils_test import gen_test
from fabric_support import lost, raw_send
from ofi_support import needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm.parcel import Message, OutgoingParcel
from dask_lcicomm.providers.message_tags import CONTROL, STREAM

#: The message fabrics; "memory" is one inside the process (tests/fabric_support.py).
FABRICS = ["memory", "tcp", needs_ucx("ucx", id="ucx"), needs_ofi("ofi", id="ofi")]


@contextlib.contextmanager
def _peer_of(intruder, fabric):
    """A peer handle of ``intruder``'s fabric for ``fabric``, closed after."""
    own = intruder.device.source
    with own.lock:
        peer = own.open_peer(fabric.address)
    try:
        yield peer
    finally:
        with own.lock:
            own.close_peer(peer)


def _parcel_bytes(vc: int, seq: int, payload: bytes) -> bytes:
    parcel = OutgoingParcel(vc, seq, [payload], 1024, 65536)
    return b"".join(bytes(b) for b in parcel.next_unit())


@pytest.mark.parametrize("fabric", FABRICS)
@gen_test(timeout=60)
async def test_a_peer_cannot_inject_into_another_peers_conversation(endpoint_pair, fabric):
    """Devices ``b`` and ``intruder`` share one fabric endpoint; the intruder knows
    everything but the route that b chose and told ``a`` alone. It sends
    well-formed parcels under every other route it might try, and a hello
    that claims to be ``a``: b's conversation with a sees none of it, and the
    fabric drops each message unread."""
    with endpoint_pair("loop", provider=fabric) as (a, b), \
            endpoint_pair("loop", provider=fabric) as (intruder, _), \
            _peer_of(intruder, b.device.source) as peer:
        shared = b.device.source
        forged = _parcel_bytes(1, 0, b"forged")
        guesses = {b.device.route ^ (1 << bit) for bit in range(32)} | {
            random.getrandbits(32) | 1 for _ in range(200)
        }
        guesses.discard(b.device.route)
        for route in sorted(guesses):
            await raw_send(intruder, forged, route, STREAM, 0, peer)
        hello = json.dumps({"address": a.device.source.address, "listener": 1, "route": 7,
                            "local": "lci://a:1", "peer": "lci://b:1"}).encode()
        await raw_send(intruder, hello, 0, CONTROL, 0, peer)
        a.send(1, OutgoingParcel(1, 0, [b"genuine"], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        await asyncio.sleep(0.5)
        messages = [e for e in b.events if isinstance(e, Message)]
        assert [bytes(m.frames[0]) for m in messages] == [b"genuine"]
        assert not lost(b.events)
        assert set(shared._routes) == {b.device.route}
        for _ in range(100):
            if not shared._orphans:
                break
            await asyncio.sleep(0.1)
        assert not shared._orphans, "dropped messages still held"


@pytest.mark.parametrize("fabric", FABRICS)
@gen_test(timeout=60)
async def test_malformed_hellos_are_dropped_and_the_fabric_keeps_serving(endpoint_pair, fabric):
    """A hello is bounded and checked before it makes anything: none of
    these makes a device, and the conversation beside them goes on."""
    with endpoint_pair("loop", provider=fabric) as (a, b), \
            endpoint_pair("loop", provider=fabric) as (intruder, _), \
            _peer_of(intruder, b.device.source) as peer:
        shared = b.device.source
        good = {"address": a.device.source.address, "listener": 1, "route": 7,
                "local": "lci://a:1", "peer": "lci://b:1"}
        hellos = [
            bytes(20 * 1024),
            b"not json",
            b"[1, 2]",
            json.dumps(good).encode(),
            json.dumps({**good, "route": 0}).encode(),
            json.dumps({**good, "route": 1 << 40}).encode(),
            json.dumps({**good, "address": "zz"}).encode(),
            json.dumps({k: v for k, v in good.items() if k != "address"}).encode(),
        ]
        for hello in hellos:
            await raw_send(intruder, hello, 0, CONTROL, 0, peer)
        a.send(1, OutgoingParcel(1, 0, [b"genuine"], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        await asyncio.sleep(0.5)
        assert set(shared._routes) == {b.device.route}
        assert not lost(b.events)

