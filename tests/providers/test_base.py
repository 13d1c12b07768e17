"""Devices of every provider: one-sided delivery, interleaving, back-pressure, loss.

``sndbuf`` is the socket buffer for tcp and the ring for shm (with no pool,
so that large frames queue in the ring as they queue in a socket).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from distributed.utils_test import gen_test
from ofi_support import needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm.parcel import Message, OutgoingParcel
from dask_lcicomm.providers.base import DeviceClosed, DeviceLost, SendDone

MODES = ["loop", "thread", "poll"]
#: "memory" is a message fabric inside the process (tests/fabric_support.py).
PROVIDERS = ["tcp", "shm", needs_ucx("ucx", id="ucx"), needs_ofi("ofi", id="ofi"), "memory"]


def _messages(events, vc=None):
    return [e for e in events if isinstance(e, Message) and (vc is None or e.vc == vc)]


def _parcel(vc, seq, frames, eager=1024, fragment=64 * 1024):
    return OutgoingParcel(vc, seq, frames, eager, fragment)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@gen_test(timeout=60)
async def test_messages_arrive_whole_and_in_order(endpoint_pair, mode, provider):
    with endpoint_pair(mode, provider=provider) as (a, b):
        rng = np.random.default_rng(0)
        sent = []
        for seq in range(50):
            frames = [rng.bytes(int(n)) for n in rng.integers(0, 200_000, size=3)]
            sent.append(frames)
            a.send(7, _parcel(7, seq, frames))
        await b.wait_for(lambda ev: len(_messages(ev)) == 50)
        got = _messages(b.events)
        assert [m.seq for m in got] == list(range(50))
        assert [[bytes(f) for f in m.frames] for m in got] == sent


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@gen_test(timeout=60)
async def test_small_parcel_overtakes_large_one_on_another_vc(endpoint_pair, mode, provider):
    with endpoint_pair(mode, sndbuf=64 * 1024, provider=provider) as (a, b):
        big = np.arange(32 << 20, dtype=np.uint8)
        a.send(1, _parcel(1, 0, [big]))
        a.send(2, _parcel(2, 0, [b"small"]))
        await b.wait_for(lambda ev: len(_messages(ev)) == 2, timeout=30)
        order = [m.vc for m in _messages(b.events)]
        assert order == [2, 1]
        assert np.array_equal(np.frombuffer(_messages(b.events, 1)[0].frames[0], np.uint8), big)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@gen_test(timeout=60)
async def test_send_completion_after_back_pressure(endpoint_pair, mode, provider):
    with endpoint_pair(mode, sndbuf=64 * 1024, provider=provider) as (a, b):
        token = asyncio.get_running_loop().create_future()
        payload = bytes(8 << 20)
        done = a.send(3, _parcel(3, 0, [payload]), token)
        assert not done, "8 MiB cannot fit a 64 KiB socket buffer at once"
        assert a.device.queued_bytes >= len(payload)
        await b.wait_for(lambda ev: len(_messages(ev)) == 1, timeout=30)
        await a.wait_for(lambda ev: any(isinstance(e, SendDone) for e in ev), timeout=30)
        assert [e.token for e in a.events if isinstance(e, SendDone)] == [token]
        assert a.device.queued_bytes == 0


#: Providers whose fabric can be busy with a large frame in the stream (a
#: message fabric takes every message at once; tcp's gathers what it queued
#: into its writes: tests/providers/test_tcp_fabric.py).
STREAM_PROVIDERS = ["shm"]


@pytest.mark.parametrize("provider", STREAM_PROVIDERS)
@gen_test(timeout=60)
async def test_parcels_queued_on_a_busy_device_leave_together(endpoint_pair, provider):
    with endpoint_pair("loop", sndbuf=64 * 1024, provider=provider) as (a, b):
        sends = []
        transmit = a.device._transmit
        a.device._transmit = lambda buffers: sends.append(len(buffers)) or transmit(buffers)
        a.send(1, _parcel(1, 0, [bytes(4 << 20)]))
        for seq in range(200):
            a.send(2, _parcel(2, seq, [b"x" * 10]))
        await b.wait_for(lambda ev: len(_messages(ev)) == 201, timeout=30)
        assert [m.seq for m in _messages(b.events, 2)] == list(range(200))
        assert len(sends) < 100, f"{len(sends)} sends for 201 parcels"


@pytest.mark.parametrize("provider", PROVIDERS)
@gen_test(timeout=60)
async def test_peer_loss_reports_pending_sends(endpoint_pair, provider):
    with endpoint_pair("loop", sndbuf=64 * 1024, provider=provider) as (a, b):
        token = asyncio.get_running_loop().create_future()
        a.send(1, _parcel(1, 0, [bytes(16 << 20)]), token)
        b.engine.remove(b.device)
        await a.wait_for(lambda ev: any(isinstance(e, DeviceLost) for e in ev))
        lost = next(e for e in a.events if isinstance(e, DeviceLost))
        assert token in lost.tokens
        with pytest.raises(DeviceClosed):
            a.send(1, _parcel(1, 1, [b"late"]))


@pytest.mark.parametrize("provider", PROVIDERS)
@gen_test(timeout=60)
async def test_a_send_error_fails_every_queued_send(endpoint_pair, provider):
    """The peer may be gone before our receive side noticed: the writers
    waiting on queued parcels must hear of it, not wait forever."""
    with endpoint_pair("loop", sndbuf=64 * 1024, provider=provider) as (a, _):
        loop = asyncio.get_running_loop()
        taken, queued = loop.create_future(), loop.create_future()
        assert not a.send(1, _parcel(1, 0, [bytes(8 << 20)]), taken)

        def broken(buffers):
            raise BrokenPipeError(32, "Broken pipe")

        a.device._transmit = broken
        a.device.put(2, _parcel(2, 0, [b"queued"]), queued)
        await a.wait_for(lambda ev: any(isinstance(e, DeviceLost) for e in ev))
        lost = next(e for e in a.events if isinstance(e, DeviceLost))
        assert "Broken pipe" in lost.reason
        assert {taken, queued} <= set(lost.tokens)


@gen_test(timeout=30)
async def test_release_waits_for_a_transmission_in_flight(endpoint_pair):
    """In thread mode the progress thread may release a device while the
    event loop's thread is inside a send on it: the transport must outlive
    that send."""
    with endpoint_pair("thread") as (a, _):
        device = a.device
        entered, proceed = threading.Event(), threading.Event()
        order = []
        transmit = device._transmit

        def slow(buffers):
            entered.set()
            proceed.wait(5)
            order.append("sent")
            return transmit(buffers)

        close = device._close_transport
        device._close_transport = lambda: (order.append("closed"), close())
        device._transmit = slow
        device.put(1, _parcel(1, 0, [b"x" * 100]))
        sender = threading.Thread(target=device.flush)
        sender.start()
        assert entered.wait(5)
        releaser = threading.Thread(target=device.release)
        releaser.start()
        releaser.join(0.2)
        assert releaser.is_alive(), "release closed the transport under a send"
        proceed.set()
        sender.join(5)
        releaser.join(5)
        assert order == ["sent", "closed"]
