"""The ucx provider's own cases: hostile messages from a UCX peer, bulk
groups out of band, two event loops of one process each on UCX, and the
options of its UCX context.
The cases every provider shares are in test_base.py and test_processes.py."""

from __future__ import annotations

import os
import socket
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
from dask_lcicomm.providers import ucx
from dask_lcicomm.providers.base import DeviceLost
from dask_lcicomm.providers.registry import ProviderUnavailable

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


def _lost(events):
    return [e for e in events if isinstance(e, DeviceLost)]


def _raw_send(sender, data: bytes, tag: int) -> None:
    """Send ``data`` with ``tag`` on ``sender``'s endpoint, as a peer that
    does not follow the protocol would."""
    sender.device._endpoint.tag_send(ucx._array(data), ucx._tag(tag))


def _unsent_group() -> bytes:
    """A parcel whose PLACED record names bulk message 7, never sent."""
    parcel = OutgoingParcel(1, 0, [bytes(100_000)], 1024, 65536)
    parcel.place(0, 7, 0)
    units = []
    while not parcel.done:
        units.extend(bytes(b) for b in parcel.next_unit())
    return b"".join(units)


HOSTILE = {
    "unknown tag": (b"x" * 16, 1 << 40),
    "garbage in the stream": (b"not a parcel stream at all", 0),
    "placed group that never arrived": (_unsent_group(), 0),
    "bulk message over the limit": (bytes(2 << 20), ucx._BULK | 5),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@gen_test(timeout=30)
async def test_a_hostile_ucx_peer_loses_its_device_alone(endpoint_pair, case):
    """The device that received it closes, reporting a protocol violation;
    a second device next to it keeps working."""
    data, tag = HOSTILE[case]
    limits = Limits(max_message_bytes=1 << 20)
    with endpoint_pair("loop", provider="ucx", limits=limits) as (a, b), \
            endpoint_pair("loop", provider="ucx") as (c, d):
        _raw_send(a, data, tag)
        await b.wait_for(lambda ev: bool(_lost(ev)))
        assert _lost(b.events)[0].violation, _lost(b.events)
        c.send(3, OutgoingParcel(3, 0, [b"still here", np.ones(200_000, np.uint8)], 1024, 65536))
        await d.wait_for(lambda ev: any(isinstance(e, Message) for e in ev))


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


@pytest.mark.parametrize("message", [b"\x05\x00\x00\x00{nope", b"\x02\x00\x00\x00[]", b"\xff\xff\xff\xff"])
@gen_test(timeout=30)
async def test_a_malformed_setup_message_refuses_that_peer(message):
    """What a peer sends on the setup socket is bounded and checked: garbage
    is ProviderUnavailable (that peer refused), never another error."""
    near, far = socket.socketpair()
    try:
        near.setblocking(False)
        far.sendall(message)
        far.shutdown(socket.SHUT_WR)
        with pytest.raises(ProviderUnavailable):
            await ucx._receive_setup(near)
    finally:
        near.close()
        far.close()


@gen_test(timeout=30)
async def test_a_peer_silent_on_the_setup_socket_is_refused_as_unavailable():
    """The accepting side's setup fails as ProviderUnavailable, whatever
    failed (here the wait for the peer's request), as the connecting side's
    does."""
    near, far = socket.socketpair()
    try:
        near.setblocking(False)
        with pytest.raises(ProviderUnavailable, match="TimeoutError"):
            await ucx.accept(near, None, timeout=0.05)
    finally:
        near.close()
        far.close()


def test_an_environment_variable_wins_over_a_configured_ucx_option(monkeypatch):
    """A ``UCX_<NAME>`` variable is the user's word for this run: the
    configured option of that name is not given to the context, where it
    would override the variable."""
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    options = {"tcp-tx-seg-size": "1m", "tls": "tcp"}
    with dask.config.set({"distributed.comm.lci.ucx-options": options}):
        assert ucx.context_options(Settings.from_config()) == {"TLS": "tcp"}


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
        "from dask_lcicomm.providers import ucx; print(ucx.unavailable())", env
    )
    assert "UCX cannot open the fabric with options" in reason and "NO_SUCH_OPTION" in reason, reason


_SHARED_MAPPINGS = (
    "from dask_lcicomm.providers import ucx\n"
    "workers = [ucx._worker() for _ in range(3)]\n"
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
