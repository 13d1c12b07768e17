"""The ucx provider's own cases: hostile messages from a UCX peer, bulk
groups out of band, two event loops of one process each on UCX, and the
options of its UCX context.
The cases every provider shares are in test_base.py and test_processes.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_test
from eventually import eventually
from ucx_support import UCX_MISSING

from dask_lcicomm import connections
from dask_lcicomm.config import Settings
from dask_lcicomm.parcel import Limits, Message, OutgoingParcel
from dask_lcicomm.providers import ucx_worker
from dask_lcicomm.providers.base import DeviceLost

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


def _lost(events):
    return [e for e in events if isinstance(e, DeviceLost)]


def _raw_send(sender, data: bytes, route: int, kind: int, number: int, endpoint=None) -> None:
    """Send ``data`` with the given tag on ``sender``'s endpoint (or on
    ``endpoint`` of its worker), as a peer that does not follow the protocol
    would."""
    worker = sender.device.source
    with worker.lock:
        request = (endpoint or sender.device._endpoint).tag_send(
            ucx_worker.array(data), ucx_worker.tag(route, kind, number)
        )
        if not request.completed:
            worker._orphans.append((request, data))


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
    "garbage in the stream": (b"not a parcel stream at all", ucx_worker.STREAM, 0),
    "placed group that never arrived": (_unsent_group(), ucx_worker.STREAM, 0),
    "bulk message over the limit": (bytes(2 << 20), ucx_worker.BULK, 5),
    "stream waiting for prompt messages never sent": (b"x", ucx_worker.STREAM, 3),
    "a second welcome": (bytes(4), ucx_worker.CONTROL, ucx_worker.WELCOME),
    "an unknown control message": (b"", ucx_worker.CONTROL, 9),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@gen_test(timeout=30)
async def test_a_hostile_ucx_peer_loses_its_device_alone(endpoint_pair, case):
    """The device that received it closes, reporting a protocol violation;
    a second device next to it keeps working."""
    data, kind, number = HOSTILE[case]
    limits = Limits(max_message_bytes=1 << 20)
    with endpoint_pair("loop", provider="ucx", limits=limits) as (a, b), \
            endpoint_pair("loop", provider="ucx") as (c, d):
        _raw_send(a, data, b.device.route, kind, number)
        await b.wait_for(lambda ev: bool(_lost(ev)))
        assert _lost(b.events)[0].violation, _lost(b.events)
        c.send(3, OutgoingParcel(3, 0, [b"still here", np.ones(200_000, np.uint8)], 1024, 65536))
        await d.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))


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
            endpoint_pair("loop", provider="ucx") as (intruder, _):
        worker = b.device.source
        with intruder.device.source.lock:
            endpoint = intruder.device.source.endpoint(worker.address)
        forged = _parcel_bytes(1, 0, b"forged")
        guesses = {b.device.route ^ (1 << bit) for bit in range(32)} | {
            random.getrandbits(32) | 1 for _ in range(200)
        }
        guesses.discard(b.device.route)
        for route in sorted(guesses):
            _raw_send(intruder, forged, route, ucx_worker.STREAM, 0, endpoint)
        hello = json.dumps({"address": a.device.source.address, "listener": 1, "route": 7,
                            "local": "lci://a:1", "peer": "lci://b:1"}).encode()
        _raw_send(intruder, hello, 0, ucx_worker.CONTROL, 0, endpoint)
        a.send(1, OutgoingParcel(1, 0, [b"genuine"], 1024, 65536))
        await b.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))
        await asyncio.sleep(0.5)
        messages = [e for e in b.events if isinstance(e, Message)]
        assert [bytes(m.frames[0]) for m in messages] == [b"genuine"]
        assert not _lost(b.events)
        assert set(worker._routes) == {b.device.route}
        for _ in range(100):
            if not worker._orphans:
                break
            await asyncio.sleep(0.1)
        assert not worker._orphans, "dropped messages still held"
        with intruder.device.source.lock:
            endpoint.close_blocking()


@gen_test(timeout=30)
async def test_a_small_parcel_passes_a_large_one_in_flight(endpoint_pair):
    """The large parcel's bulk group travels out of band: the small parcel
    written after it on another virtual connection is delivered first."""
    with endpoint_pair("loop", provider="ucx") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [np.ones(64 << 20, np.uint8)], 1024, 65536))
        a.send(2, OutgoingParcel(2, 0, [b"small"], 1024, 65536))
        await b.wait_for(lambda ev: sum(isinstance(e, Message) for e in ev) == 2, timeout=30)
        assert [e.vc for e in b.events if isinstance(e, Message)] == [2, 1]


def test_two_event_loops_of_one_process_both_progress():
    """A LocalCluster's loop and a Client's loop in another thread, both on
    UCX alone: each loop has its own parcelport and UCX workers (the
    deadlock of several loops sharing UCX, dask-cuda#863, cannot happen)."""
    with dask.config.set({"distributed.comm.lci.providers": ["ucx"]}), LocalCluster(
        protocol="lci", host="127.0.0.1", processes=False, n_workers=2, threads_per_worker=1,
        dashboard_address=":0",
    ) as cluster:
        results: dict[str, object] = {}

        def use_from_another_thread() -> None:
            with Client(cluster.scheduler_address, timeout=30) as client:
                x = client.submit(np.arange, 1 << 20, workers=[sorted(cluster.workers)[0]], pure=False)
                results["sum"] = client.submit(np.sum, x).result(timeout=30)

                def scheduler_providers() -> set[str]:
                    found = {c["provider"] for c in client.run_on_scheduler(connections)}
                    assert found == {"ucx"}, found
                    return found

                results["providers"] = eventually(scheduler_providers)

        thread = threading.Thread(target=use_from_another_thread)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the client's loop stopped progressing"
    assert results == {"sum": (1 << 20) * ((1 << 20) - 1) // 2, "providers": {"ucx"}}


def test_an_environment_variable_wins_over_a_configured_ucx_option(monkeypatch):
    """A ``UCX_<NAME>`` variable is the user's word for this run: the
    configured option of that name is not given to the context, where it
    would override the variable."""
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    options = {"tcp-tx-seg-size": "1m", "tls": "tcp"}
    with dask.config.set({"distributed.comm.lci.ucx-options": options}):
        assert ucx_worker.context_options(Settings.from_config()) == {"TLS": "tcp"}


def _printed_by_a_fresh_process(code: str, env: dict[str, str]) -> str:
    """What ``code`` prints in a new interpreter: UCX reads its options once
    per process, when it is first used, so each case needs a process of its own."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
        timeout=60,
    ).stdout


def test_an_option_ucx_refuses_is_named_in_why_ucx_is_unavailable():
    """The provider is unavailable, and the reason names the options."""
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__LCI__UCX_OPTIONS": '{"no-such-option": "1"}'}
    reason = _printed_by_a_fresh_process(
        "from dask_lcicomm.providers import ucx_worker; print(ucx_worker.unavailable())", env
    )
    assert "UCX cannot open the fabric with options" in reason and "NO_SUCH_OPTION" in reason, reason


_SHARED_MAPPINGS = (
    "from dask_lcicomm.providers import ucx_worker\n"
    "workers = [ucx_worker.new_worker() for _ in range(3)]\n"
    "maps = open('/proc/self/maps').read().splitlines()\n"
    "print(sum(line.endswith('(deleted)') or '/dev/shm/' in line for line in maps))\n"
)


@pytest.mark.parametrize("tls", [None, "all"])
def test_the_shipped_options_keep_shared_memory_out_of_ucx_workers(tls):
    """Peers on one host use the shm provider, so the shipped options leave
    out UCX's shared-memory transports, which map FIFOs into every device's
    worker; ``UCX_TLS=all`` brings them back."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls is not None:
        env["UCX_TLS"] = tls
    shared = _printed_by_a_fresh_process(_SHARED_MAPPINGS, env)
    assert (int(shared) == 0) == (tls is None), shared
