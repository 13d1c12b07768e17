"""Every resource has an owner and a way back: fds, shared memory, threads,
timers and comms nobody closed, under the lifetimes Dask gives them."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, Scheduler, Worker
from distributed.comm import connect, listen
from distributed.comm.core import CommClosedError
from distributed.comm.registry import get_backend
from distributed.utils_test import gen_test
from ofi_support import needs_ofi
from tornado.ioloop import IOLoop
from ucx_support import needs_ucx

from dask_lcicomm import parcelport as parcelport_module
from dask_lcicomm.config import Settings
from dask_lcicomm.link import LINGER
from dask_lcicomm.parcelport import Parcelport
from dask_lcicomm.providers import frame_memory, shm, shm_budget
from dask_lcicomm.providers.shm_options import ShmOptions

PROVIDERS = [
    pytest.param(["shm", "tcp"], id="shm"),
    pytest.param(["tcp"], id="tcp"),
    needs_ucx(["ucx", "tcp"], id="ucx"),
    needs_ofi(["ofi", "tcp"], id="ofi"),
    # a message fabric inside the process (tests/fabric_support.py)
    pytest.param(["memory"], id="memory"),
]
MODES = ["loop", "thread"]


def resources() -> dict[str, Any]:
    """What an lci:// process holds that must go when its comms do (after a
    collection, so that garbage of earlier tests in this process does not
    count as held)."""
    gc.collect()
    fds = set(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = [line for line in f if "dask-lcicomm" in line or "ucx_shm_posix_" in line]
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("lci-progress"))
    lent = shm_budget.budget(ShmOptions.of(Settings.from_config()).budget).held
    return {"fds": len(fds), "segments mapped": len(maps), "progress threads": threads,
            "shared memory lent": lent, "frame memory": frame_memory.held_by_process()}


def at_most(now: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """No more fds, segments, progress threads or memory than at ``baseline``
    (what earlier tests left may go meanwhile: a progress thread of theirs
    still winding down, say)."""
    return (
        now["fds"] <= baseline["fds"]
        and now["segments mapped"] <= baseline["segments mapped"]
        and set(now["progress threads"]) <= set(baseline["progress threads"])
        and now["shared memory lent"] <= baseline["shared memory lent"]
        and now["frame memory"] <= baseline["frame memory"]
    )


async def back_to(baseline: dict[str, Any], within: float = LINGER + 5) -> bool:
    """Wait (bounded) until the process holds no more than at ``baseline``."""
    deadline = time.monotonic() + within
    while True:
        if at_most(resources(), baseline):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


def settled(check: Callable[[], bool], within: float = LINGER + 5) -> bool:
    """Whether ``check`` holds at some reading within ``within`` seconds. The
    verdict is that reading's, not a fresh one: the in-process cluster's
    threads briefly hold descriptors of their own (a fresh reading once saw
    one more fd, and the next one none)."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _config(providers, mode="loop"):
    return dask.config.set({
        "distributed.comm.lci.providers": providers,
        "distributed.comm.lci.progress": mode,
    })


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("providers", PROVIDERS)
@gen_test(timeout=60)
async def test_comms_and_listeners_leave_nothing_behind(providers, mode):
    baseline = resources()
    with _config(providers, mode):
        async def echo(comm):
            try:
                while True:
                    await comm.write(await comm.read())
            except CommClosedError:
                pass

        listener = await listen("lci://127.0.0.1:0", echo)
        comms = [await connect(listener.contact_address) for _ in range(4)]
        for i, comm in enumerate(comms):
            await comm.write({"x": np.full(3 << 20, i, dtype=np.uint8), "i": i})
            echoed = await comm.read()
            assert echoed["i"] == i and int(echoed["x"][-1]) == i
        del echoed
        for comm in comms:
            await comm.close()
        listener.stop()
    assert await back_to(baseline), (resources(), baseline)


@pytest.mark.parametrize("providers", PROVIDERS)
@gen_test(timeout=60)
async def test_comms_dropped_without_close_are_finalized(providers):
    """As tcp:// closes a dangling stream: here the peer closes first, then
    the comm is dropped (Dask's ConnectionPool does that)."""
    baseline = resources()
    with _config(providers):
        served: list = []

        async def close_at_once(comm):
            served.append(comm.peer_address)
            await comm.close()

        listener = await listen("lci://127.0.0.1:0", close_at_once)
        for _ in range(30):
            comm = await connect(listener.contact_address)
            deadline = time.monotonic() + 5
            while not comm.closed() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert comm.closed()
            del comm
        assert len(served) == 30
        listener.stop()
    assert await back_to(baseline), (resources(), baseline)


@gen_test(timeout=30)
async def test_a_dropped_comm_is_closed_for_its_peer():
    reads: asyncio.Queue = asyncio.Queue()

    async def wait_for_close(comm):
        try:
            await comm.read()
        except CommClosedError as e:
            await reads.put(e)

    async with listen("lci://127.0.0.1:0", wait_for_close) as listener:
        comm = await connect(listener.contact_address)
        del comm
        gc.collect()
        assert isinstance(await asyncio.wait_for(reads.get(), 5), CommClosedError)


@pytest.mark.parametrize("providers", PROVIDERS)
@gen_test(timeout=60)
async def test_a_cluster_lifetime_leaves_nothing_behind(providers):
    baseline = resources()
    with _config(providers):
        async with (
            Scheduler(protocol="lci", dashboard_address=":0") as s,
            Worker(s.address) as a,
            Worker(s.address) as b,
            Client(s.address, asynchronous=True) as c,
        ):
            x = c.submit(np.arange, 1 << 20, workers=[a.address])
            y = c.submit(lambda v: int(v.sum()), x, workers=[b.address])
            assert await y == sum(range(1 << 20))
            del x, y
    assert await back_to(baseline), (resources(), baseline)


@gen_test(timeout=30)
async def test_connecting_to_a_tcp_listener_fails_fast_and_says_why():
    tcp = get_backend("tcp").get_listener("tcp://127.0.0.1:0", lambda comm: None, True)
    await tcp.start()
    try:
        host_port = tcp.contact_address.split("://")[1]
        start = time.monotonic()
        with pytest.raises(OSError, match="not an lci:// listener"):
            await connect(f"lci://{host_port}", timeout=30)
        assert time.monotonic() - start < 2
    finally:
        tcp.stop()


@gen_test(timeout=30)
async def test_two_concurrent_reads_fail_loudly():
    async with listen("lci://127.0.0.1:0", lambda comm: asyncio.sleep(30)) as listener:
        comm = await connect(listener.contact_address)
        first = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="already waiting"):
            await comm.read()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(first, 5)
        assert comm.closed()


@gen_test(timeout=30)
async def test_a_comm_opened_just_before_the_listener_stops_never_reaches_the_handler():
    """As tcp:// closes a stream accepted just before stop(): the handler
    never sees the comm, and the peer sees it closed instead of hanging in
    Dask's handshake (which has no timeout)."""
    handled = []
    listener = await listen("lci://127.0.0.1:0", handled.append)
    registration = listener._listening
    accept = registration.accept

    def accept_then_stop(vconn):
        accept(vconn)
        listener.stop()

    registration.accept = accept_then_stop
    with pytest.raises(OSError, match=r"closed|refused"):
        await connect(listener.contact_address, timeout=5)
    await asyncio.sleep(0.1)
    assert handled == []


@gen_test(timeout=30)
async def test_a_peer_that_never_greets_times_out_quietly(caplog):
    """The connect fails within its timeout; nothing is left unretrieved."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "0.5s"}), pytest.raises(OSError):
            await connect(f"lci://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
        await asyncio.sleep(0.2)
        gc.collect()
        await asyncio.sleep(0.1)
        # The failed greeting's link is gone, and the parcelport with it.
        assert Parcelport._ports.get(asyncio.get_running_loop()) is None
    finally:
        silent.close()
    assert "never retrieved" not in caplog.text


@gen_test(timeout=30)
async def test_a_listener_that_fails_to_start_leaves_no_socket(monkeypatch):
    baseline = resources()

    def broken(*args, **kwargs):
        raise OSError("no shared memory today")

    monkeypatch.setattr(shm.PROVIDER, "listen", broken)
    with _config(["shm", "tcp"]):
        port = socket.socket()
        port.bind(("127.0.0.1", 0))
        number = port.getsockname()[1]
        port.close()
        with pytest.raises(OSError, match="no shared memory today"):
            await listen(f"lci://127.0.0.1:{number}", lambda comm: None)
        # The port is free again and nothing was kept.
        with socket.socket() as again:
            again.bind(("127.0.0.1", number))
    assert await back_to(baseline), (resources(), baseline)


@gen_test(timeout=60)
async def test_a_finished_link_leaves_no_linger_timer():
    async with listen("lci://127.0.0.1:0", lambda comm: comm.close()) as listener:
        comm = await connect(listener.contact_address)
        await comm.close()
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 5
    while Parcelport._ports.get(loop) is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert Parcelport._ports.get(loop) is None
    timers = [
        handle for handle in loop._scheduled  # type: ignore[attr-defined]
        if not handle.cancelled() and getattr(handle._callback, "__self__", None).__class__
        is parcelport_module.Parcelport
    ]
    assert timers == []


@gen_test(timeout=30)
async def test_numeric_addresses_connect_without_the_default_executor():
    """Dask still closes and connects during interpreter shutdown, when the
    executor that resolves names refuses work."""
    async with listen("lci://127.0.0.1:0", lambda comm: comm.close()) as listener:
        await asyncio.get_running_loop().shutdown_default_executor()
        comm = await connect(listener.contact_address, timeout=5)
        await comm.close()


def test_synchronous_clients_leave_nothing_behind():
    """A synchronous Client stops its event loop right after closing: its
    links must not wait for that loop to finish closing them."""
    baseline = resources()
    with _config(["shm", "tcp"]), LocalCluster(
        processes=False, protocol="lci", n_workers=1, dashboard_address=":0"
    ) as cluster:
        with Client(cluster.scheduler_address) as client:
            assert client.submit(abs, -1).result() == 1
        # The cluster's own comms (opened by the first computation) stay.
        time.sleep(0.5)
        after_first = resources()

        def no_more_than_after_first() -> bool:
            now = resources()
            return all(now[key] <= after_first[key] for key in ("fds", "segments mapped"))

        for i in range(3):
            with Client(cluster.scheduler_address) as client:
                assert client.submit(abs, -i).result() == i
        assert settled(no_more_than_after_first), (resources(), after_first)
    assert settled(lambda: at_most(resources(), baseline)), (resources(), baseline)



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("providers", PROVIDERS)
def test_a_loop_closed_with_its_descriptors_releases_what_nobody_closed(providers, mode):
    """Dask ends its test and subprocess loops with tornado's
    ``IOLoop.close(all_fds=True)``, which closes tcp's sockets of servers
    nobody closed: the listener, comms and shared memory of lci:// go too."""
    baseline = resources()
    ioloops: list[IOLoop] = []

    async def leave_open() -> list[Any]:
        ioloops.append(IOLoop.current())
        served: list[Any] = []

        async def keep(comm):
            served.append(comm)
            await comm.write(await comm.read())

        listener = await listen("lci://127.0.0.1:0", keep)
        comm = await connect(listener.contact_address)
        await comm.write(np.ones(1 << 20, dtype=np.uint8))
        await comm.read()
        return [listener, comm, served]

    with _config(providers, mode):
        kept = asyncio.run(leave_open())
    assert not at_most(resources(), baseline), "nothing was left open to release"
    ioloops[0].close(all_fds=True)
    assert settled(lambda: at_most(resources(), baseline), within=5), (resources(), baseline)
    del kept
