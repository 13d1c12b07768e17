"""Choosing the provider per peer when a channel opens."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import dask
import pytest
from distributed.comm import connect, listen
from distributed.comm.core import FatalCommClosedError
from distributed.comm.registry import get_backend
from distributed.utils_test import gen_test

from dask_lcicomm.providers import registry, shm_handshake, ucx_context


async def _pair(**connect_kwargs):
    accepted: asyncio.Queue = asyncio.Queue()
    listener = listen("lci://127.0.0.1:0", accepted.put)
    await listener.start()
    comm = await connect(listener.contact_address, **connect_kwargs)
    return listener, comm, await asyncio.wait_for(accepted.get(), 10)


async def _close(listener, *comms):
    for comm in comms:
        await comm.close()
    listener.stop()


def _counting_bootstraps(monkeypatch) -> list[int]:
    """The devices each channel of this process opens over the bootstrap provider."""
    from dask_lcicomm.link import Links

    opened: list[int] = []
    original = Links.bootstrap

    def counted(self, host, port, index):
        opened.append(index)
        return original(self, host, port, index)

    monkeypatch.setattr(Links, "bootstrap", counted)
    return opened


@pytest.mark.parametrize("bound", ["127.0.0.1", "0.0.0.0"])
@gen_test(timeout=30)
async def test_peers_on_one_host_use_shared_memory_with_no_tcp_connection_first(monkeypatch, bound):
    bootstraps = _counting_bootstraps(monkeypatch)
    accepted: asyncio.Queue = asyncio.Queue()
    listener = listen(f"lci://{bound}:0", accepted.put)
    await listener.start()
    address = f"lci://127.0.0.1:{listener.listen_address.rsplit(':', 1)[1]}"
    near = await connect(address)
    far = await asyncio.wait_for(accepted.get(), 10)
    try:
        assert bootstraps == []
        assert near.extra_info["provider"] == far.extra_info["provider"] == "shm"
        assert near.extra_info["peer_pid"] == far.extra_info["peer_pid"] == os.getpid()
        assert near.peer_address == far.local_address == address
        assert far.peer_address == near.local_address
        await near.write({"x": b"a" * 200_000})
        assert await far.read() == {"x": b"a" * 200_000}
        await far.write("back")
        assert await near.read() == "back"
    finally:
        await _close(listener, near, far)


@pytest.mark.parametrize("providers", [["tcp"], ["tcp", "shm"]])
@gen_test(timeout=30)
async def test_providers_that_prefer_tcp_use_tcp(providers):
    with dask.config.set({"distributed.comm.lci.providers": providers}):
        listener, near, far = await _pair()
    try:
        assert near.extra_info["provider"] == far.extra_info["provider"] == "tcp"
        await near.write("over tcp")
        assert await far.read() == "over tcp"
    finally:
        await _close(listener, near, far)


@gen_test(timeout=30)
async def test_a_refused_peer_falls_back_to_tcp_with_a_logged_reason(monkeypatch, caplog):
    monkeypatch.setattr(shm_handshake.os, "getuid", lambda: 4242)
    bootstraps = _counting_bootstraps(monkeypatch)
    with caplog.at_level(logging.INFO, "dask_lcicomm"):
        listener, near, far = await _pair()
    try:
        assert bootstraps == [0]
        assert near.extra_info["provider"] == far.extra_info["provider"] == "tcp"
        assert "does not use shm" in caplog.text and "runs as uid" in caplog.text
        await far.write("still works")
        assert await near.read() == "still works"
    finally:
        await _close(listener, near, far)


@gen_test(timeout=30)
async def test_replicated_shm_devices_carry_comms_round_robin():
    with dask.config.set({"distributed.comm.lci.ndevices": 2}):
        accepted: asyncio.Queue = asyncio.Queue()
        listener = listen("lci://127.0.0.1:0", accepted.put)
        await listener.start()
        comms = [await connect(listener.contact_address) for _ in range(4)]
    peers = [await asyncio.wait_for(accepted.get(), 10) for _ in comms]
    try:
        assert {c.extra_info["provider"] for c in comms + peers} == {"shm"}
        assert sorted(c.extra_info["device"] for c in comms) == [0, 0, 1, 1]
        for i, comm in enumerate(comms):
            await comm.write(i)
        assert sorted([await p.read() for p in peers]) == [0, 1, 2, 3]
    finally:
        await _close(listener, *comms, *peers)


@gen_test(timeout=30)
async def test_a_connect_that_gave_up_leaves_its_channel_for_the_retry(monkeypatch):
    """Dask's connect() cancels an attempt after a fifth of its timeout and
    tries again: the links the first attempt opened serve the second, and
    close by themselves if nobody comes."""
    from dask_lcicomm import channel as channel_module
    from dask_lcicomm.link import Links
    from dask_lcicomm.parcelport import Parcelport

    opened = []
    original = Links.bootstrap

    async def slow_bootstrap(self, host, port, index):
        opened.append(index)
        await asyncio.sleep(0.3)
        return await original(self, host, port, index)

    monkeypatch.setattr(Links, "bootstrap", slow_bootstrap)
    monkeypatch.setattr(channel_module, "GRACE", 0.5)
    with dask.config.set({"distributed.comm.lci.providers": ["tcp"]}):
        async with listen("lci://127.0.0.1:0", lambda comm: comm.close()) as listener:
            backend = get_backend("lci")
            address = listener.contact_address.split("://")[1]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(backend.get_connector().connect(address), 0.1)
            await asyncio.sleep(0.4)
            comm = await asyncio.wait_for(backend.get_connector().connect(address), 5)
            assert opened == [0]
            await comm.close()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(backend.get_connector().connect(address), 0.1)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while Parcelport._ports.get(loop) is not None and loop.time() < deadline:
                await asyncio.sleep(0.05)
    assert Parcelport._ports.get(asyncio.get_running_loop()) is None


@gen_test(timeout=30)
async def test_a_required_provider_is_used():
    with dask.config.set({"distributed.comm.lci.providers": ["shm"]}):
        listener, near, far = await _pair()
    try:
        assert near.extra_info["provider"] == far.extra_info["provider"] == "shm"
    finally:
        await _close(listener, near, far)


@gen_test(timeout=30)
async def test_a_peer_no_required_provider_reaches_is_refused_at_once_with_the_reasons(monkeypatch):
    monkeypatch.setattr(shm_handshake.os, "getuid", lambda: 4242)
    with dask.config.set({"distributed.comm.lci.providers": ["shm"]}):
        listener = listen("lci://127.0.0.1:0", lambda comm: None)
        await listener.start()
        start = time.monotonic()
        try:
            with pytest.raises(FatalCommClosedError, match=r"shm: .*runs as uid"):
                await connect(listener.contact_address, timeout=30)
        finally:
            listener.stop()
    assert time.monotonic() - start < 5


def _ucx_broken(monkeypatch) -> None:
    """UCX as it is where ucxx is missing or cannot open the fabric."""
    monkeypatch.setattr(ucx_context._Context, "_context", None)
    monkeypatch.setattr(ucx_context._Context, "_error", "UCX cannot open the fabric: (simulated)")
    # The reason is logged once per process: forget that an earlier test saw it.
    registry._report_unavailable.cache_clear()


@gen_test(timeout=30)
async def test_unusable_ucx_falls_back_to_the_next_provider_with_a_warning(monkeypatch, caplog):
    _ucx_broken(monkeypatch)
    with caplog.at_level(logging.WARNING, "dask_lcicomm"), dask.config.set(
        {"distributed.comm.lci.providers": ["ucx", "tcp"]}
    ):
        listener, near, far = await _pair()
    try:
        assert near.extra_info["provider"] == "tcp"
        assert "provider ucx is unavailable: UCX cannot open the fabric" in caplog.text
    finally:
        await _close(listener, near, far)


@gen_test(timeout=30)
async def test_unusable_ucx_as_the_only_provider_is_an_error_naming_the_cause(monkeypatch):
    _ucx_broken(monkeypatch)
    with dask.config.set({"distributed.comm.lci.providers": ["ucx"]}):
        listener = listen("lci://127.0.0.1:0", lambda comm: None)
        await listener.start()
        start = time.monotonic()
        try:
            with pytest.raises(FatalCommClosedError, match="ucx: UCX cannot open the fabric"):
                await connect(listener.contact_address, timeout=30)
        finally:
            listener.stop()
    assert time.monotonic() - start < 5
