"""The shared UCX worker: routes keep peers apart, hellos are checked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import pytest
from distributed.utils_test import gen_test
from ucx_support import UCX_MISSING, lost, raw_send

from dask_lcicomm.parcel import Message, OutgoingParcel
from dask_lcicomm.providers import ucx_context

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


@contextlib.contextmanager
def _endpoint_of(intruder, worker):
    """An endpoint from ``intruder``'s worker to ``worker``, closed after."""
    own = intruder.device.source
    with own.lock:
        endpoint = own.endpoint(worker.address)
    try:
        yield endpoint
    finally:
        with own.lock:
            endpoint.close_blocking()


def _parcel_bytes(vc: int, seq: int, payload: bytes) -> bytes:
    parcel = OutgoingParcel(vc, seq, [payload], 1024, 65536)
    return b"".join(bytes(b) for b in parcel.next_unit())


@gen_test(timeout=60)
async def test_a_peer_cannot_inject_into_another_peers_conversation(endpoint_pair):
    """Devices ``b`` and ``intruder`` share one UCX worker; the intruder knows
    everything but the route that b chose and told ``a`` alone. It sends
    well-formed parcels under every other route it might try, and a hello
    that claims to be ``a``: b's conversation with a sees none of it, and the
    worker drops each message unread."""
    with endpoint_pair("loop", provider="ucx") as (a, b), \
            endpoint_pair("loop", provider="ucx") as (intruder, _), \
            _endpoint_of(intruder, b.device.source) as endpoint:
        worker = b.device.source
        forged = _parcel_bytes(1, 0, b"forged")
        guesses = {b.device.route ^ (1 << bit) for bit in range(32)} | {
            random.getrandbits(32) | 1 for _ in range(200)
        }
        guesses.discard(b.device.route)
        for route in sorted(guesses):
            raw_send(intruder, forged, route, ucx_context.STREAM, 0, endpoint)
        hello = json.dumps({"address": a.device.source.address, "listener": 1, "route": 7,
                            "local": "lci://a:1", "peer": "lci://b:1"}).encode()
        raw_send(intruder, hello, 0, ucx_context.CONTROL, 0, endpoint)
        a.send(1, OutgoingParcel(1, 0, [b"genuine"], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        await asyncio.sleep(0.5)
        messages = [e for e in b.events if isinstance(e, Message)]
        assert [bytes(m.frames[0]) for m in messages] == [b"genuine"]
        assert not lost(b.events)
        assert set(worker._routes) == {b.device.route}
        for _ in range(100):
            if not worker._orphans:
                break
            await asyncio.sleep(0.1)
        assert not worker._orphans, "dropped messages still held"


@gen_test(timeout=60)
async def test_malformed_hellos_are_dropped_and_the_worker_keeps_serving(endpoint_pair):
    """A hello is bounded and checked before it makes anything: none of
    these makes a device, and the conversation beside them goes on."""
    with endpoint_pair("loop", provider="ucx") as (a, b), \
            endpoint_pair("loop", provider="ucx") as (intruder, _), \
            _endpoint_of(intruder, b.device.source) as endpoint:
        worker = b.device.source
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
            raw_send(intruder, hello, 0, ucx_context.CONTROL, 0, endpoint)
        a.send(1, OutgoingParcel(1, 0, [b"genuine"], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        await asyncio.sleep(0.5)
        assert set(worker._routes) == {b.device.route}
        assert not lost(b.events)

