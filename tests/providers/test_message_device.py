"""A message device's own cases, on every message fabric: hostile messages
on its route, bulk groups out of band, large groups read in place where the
fabric has RMA. The cases every provider shares are in test_base.py."""

from __future__ import annotations

import asyncio
import struct

import dask
import numpy as np
import pytest
from distributed.utils_test import gen_test
from fabric_support import MemoryFabric, lost, raw_send
from ofi_support import OFI_MISSING, needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm.parcel import Limits, Message, OutgoingParcel
from dask_lcicomm.providers import message_tags
from dask_lcicomm.providers.base import SendDone
from dask_lcicomm.providers.message_rendezvous import read_message

#: The message fabrics; "memory" is one inside the process (tests/fabric_support.py).
FABRICS = ["memory", "tcp", needs_ucx("ucx", id="ucx"), needs_ofi("ofi", id="ofi")]
#: Those with RMA.
READING_FABRICS = ["memory", needs_ofi("ofi", id="ofi")]


def _readable(number: int, *buffers: tuple[int, int, int]) -> bytes:
    """A READABLE announcing ``(address, key, length)`` buffers."""
    head = struct.pack("<II", number, len(buffers))
    return head + b"".join(struct.pack("<QQQ", *buffer) for buffer in buffers)


def _unsent_group() -> bytes:
    """A parcel whose PLACED record names bulk message 7, never sent."""
    parcel = OutgoingParcel(1, 0, [bytes(100_000)], 1024, 65536)
    parcel.place(0, 7, 0)
    units = []
    while not parcel.done:
        units.extend(bytes(b) for b in parcel.next_unit())
    return b"".join(units)


#: What a peer sends on its own route, as (data, kind, number).
HOSTILE = {
    "garbage in the stream": (b"not a parcel stream at all", message_tags.STREAM, 0),
    "placed group that never arrived": (_unsent_group(), message_tags.STREAM, 0),
    "bulk message over the limit": (bytes(2 << 20), message_tags.BULK, 5),
    "stream waiting for prompt messages never sent": (b"x", message_tags.STREAM, 3),
    "a second welcome": (bytes(4), message_tags.CONTROL, message_tags.WELCOME),
    "an unknown control message": (b"", message_tags.CONTROL, 9),
    "a read message for a group never lent": (read_message(123), message_tags.CONTROL, message_tags.READ),
    "a malformed readable announcement": (b"junk", message_tags.CONTROL, message_tags.READABLE),
    "a readable announcement over the limit": (
        _readable(1, (0, 1, 2 << 20)), message_tags.CONTROL, message_tags.READABLE
    ),
}


@pytest.mark.parametrize("fabric", FABRICS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
@gen_test(timeout=30)
async def test_a_hostile_peer_loses_its_device_alone(endpoint_pair, case, fabric):
    """The device that received it closes, reporting a protocol violation;
    a second device next to it keeps working."""
    data, kind, number = HOSTILE[case]
    limits = Limits(max_message_bytes=1 << 20)
    with endpoint_pair("loop", provider=fabric, limits=limits) as (a, b), \
            endpoint_pair("loop", provider=fabric) as (c, d):
        await raw_send(a, data, b.device.route, kind, number)
        await b.wait_for(lambda ev: bool(lost(ev)))
        assert lost(b.events)[0].violation, lost(b.events)
        c.send(3, OutgoingParcel(3, 0, [b"still here", np.ones(200_000, np.uint8)], 1024, 65536))
        await d.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))


@pytest.mark.parametrize("fabric", FABRICS)
@gen_test(timeout=30)
async def test_a_small_parcel_passes_a_large_one_in_flight(endpoint_pair, fabric):
    """The large parcel's bulk group travels out of band: the small parcel
    written after it on another virtual connection is delivered first."""
    with endpoint_pair("loop", provider=fabric) as (a, b):
        a.send(1, OutgoingParcel(1, 0, [np.ones(64 << 20, np.uint8)], 1024, 65536))
        a.send(2, OutgoingParcel(2, 0, [b"small"], 1024, 65536))
        await b.wait_for(lambda ev: sum(isinstance(e, Message) for e in ev) == 2, timeout=30)
        assert [e.vc for e in b.events if isinstance(e, Message)] == [2, 1]


@gen_test(timeout=30)
async def test_a_fabric_that_never_takes_a_send_loses_the_device_within_the_connect_timeout(
    endpoint_pair, monkeypatch
):
    """Every send answered "retry": the device is lost, naming why, once
    Dask's connect timeout has passed; progress polls meanwhile, and stops."""
    monkeypatch.setattr(MemoryFabric, "connect_retries", 1 << 30)
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}), \
            endpoint_pair("loop", provider="memory") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [b"never taken"], 1024, 65536))
        await a.wait_for(lambda ev: bool(lost(ev)), timeout=10)
        assert "took no send" in lost(a.events)[0].reason
        assert not [e for e in b.events if isinstance(e, Message)]


@gen_test(timeout=30)
async def test_a_peer_reached_once_is_lost_only_after_dasks_tcp_timeout(endpoint_pair):
    """Before the fabric took a send, "retry" for the connect timeout makes a
    peer unreachable; after, it may be a busy peer's backpressure, and only
    Dask's TCP timeout without a send taken makes the peer lost."""
    timeouts = {"distributed.comm.timeouts.connect": "0.2s", "distributed.comm.timeouts.tcp": "1.5s"}
    with dask.config.set(timeouts), endpoint_pair("loop", provider="memory") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [bytes(4)], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        a.device.peer.retries = 1 << 30
        a.send(1, OutgoingParcel(1, 1, [b"late"], 1024, 65536))
        await asyncio.sleep(0.8)
        assert a.device.unposted and not lost(a.events)
        await a.wait_for(lambda ev: bool(lost(ev)), timeout=10)
        assert "it is gone" in lost(a.events)[0].reason


def _registrations(monkeypatch, fabric) -> list[int]:
    """The sizes of the buffers ``fabric`` registers from now on."""
    sizes: list[int] = []
    register = fabric.register

    def counted(buffer):
        sizes.append(memoryview(buffer).nbytes)
        return register(buffer)

    monkeypatch.setattr(fabric, "register", counted)
    return sizes


@pytest.mark.parametrize("fabric", READING_FABRICS)
@gen_test(timeout=30)
async def test_a_large_group_is_read_in_place_and_its_memory_given_back(endpoint_pair, fabric, monkeypatch):
    """A group from the fabric's rendezvous size on is registered and read
    by the peer; the parcel arrives whole and every registration is undone.
    Smaller groups, of that parcel and of another, are sent."""
    with endpoint_pair("loop", provider=fabric) as (a, b):
        least = a.device.source.rendezvous_bytes
        registered = _registrations(monkeypatch, a.device.source)
        frames = [np.arange(least, dtype=np.uint8), np.full(least // 2, 7, np.uint8)]
        a.send(1, OutgoingParcel(1, 0, [b"head", *frames], 1024, 65536), token="large")
        a.send(2, OutgoingParcel(2, 0, [np.ones(least // 2, np.uint8)], 1024, 65536))
        await b.wait_for(lambda ev: sum(isinstance(e, Message) for e in ev) == 2, timeout=30)
        await a.wait_for(lambda ev: any(isinstance(e, SendDone) and e.token == "large" for e in ev))
        large = next(e for e in b.events if isinstance(e, Message) and e.vc == 1)
        assert [bytes(f) for f in large.frames[1:]] == [f.tobytes() for f in frames]
        assert registered == [least]
        assert not a.device._loans and not b.device._inbox.busy
        if fabric == "memory":
            assert not a.device.source.regions


@gen_test(timeout=30)
async def test_over_ofi_without_rma_a_large_group_is_sent(endpoint_pair):
    """``rendezvous-bytes: 0`` opens the endpoint without RMA."""
    if OFI_MISSING:
        pytest.skip(f"no ofi provider: {OFI_MISSING}")
    with dask.config.set({"distributed.comm.lci.ofi.rendezvous-bytes": 0}), \
            endpoint_pair("loop", provider="ofi") as (a, b):
        assert a.device.source.rma is None
        data = np.arange(16 << 20, dtype=np.uint8)
        a.send(1, OutgoingParcel(1, 0, [data], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev), timeout=30)
        assert bytes(b.events[-1].frames[0]) == data.tobytes()


@pytest.mark.parametrize("fabric", READING_FABRICS)
@gen_test(timeout=30)
async def test_a_peer_announcing_memory_it_never_registered_loses_its_device_alone(endpoint_pair, fabric):
    """The read fails: that device is lost with the reason, nothing is
    acknowledged, and a device next to it keeps working."""
    with endpoint_pair("loop", provider=fabric) as (a, b), endpoint_pair("loop", provider=fabric) as (c, d):
        await raw_send(a, _readable(3, (1 << 40, 987654321, 4096)), b.device.route,
                       message_tags.CONTROL, message_tags.READABLE)
        await b.wait_for(lambda ev: bool(lost(ev)))
        assert "read failed" in lost(b.events)[0].reason, lost(b.events)
        c.send(3, OutgoingParcel(3, 0, [b"still here", np.ones(8 << 20, np.uint8)], 1024, 65536))
        await d.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
