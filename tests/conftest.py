"""Shared fixtures: devices over a socket pair (and, for shm, two shared
segments; for ucx and the in-process message fabric, the fabric endpoints
of two engines), progressed by a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import pytest
from fabric_support import ListeningTcpFabric, MemoryFabric, fabric_devices, install_memory_provider
from ofi_support import ofi_devices
from ucx_support import ucx_devices

from dask_lcicomm.parcel import Limits
from dask_lcicomm.progress import ProgressEngine, make_completion
from dask_lcicomm.providers import shm_segment
from dask_lcicomm.providers.base import DeviceOptions
from dask_lcicomm.providers.frame_memory import frame_memory
from dask_lcicomm.providers.shm import ShmDevice
from dask_lcicomm.providers.shm_handshake import ShmLink
from dask_lcicomm.providers.shm_release import releaser

#: The in-process message fabric is a provider every test may name.
install_memory_provider()


class Endpoint:
    """A device, its engine and everything its completion object delivered.
    Without a ``transport`` the device comes later, through :meth:`attach`."""

    def __init__(self, loop, transport, mode, completion="queue", accepting=False, **device_kwargs):
        self.device = None
        self.events: list = []
        self.arrived = asyncio.Event()
        self.completion = make_completion(
            completion, loop, self._handle, threadsafe=mode == "thread"
        )
        self.engine = ProgressEngine(loop, mode, self.completion, poll_interval=0.001)
        self.options = options = DeviceOptions(
            completion=self.completion,
            progress=self.engine,
            limits=device_kwargs.pop("limits", Limits()),
            batch_bytes=device_kwargs.pop("batch_bytes", 1 << 20),
            accepting=accepting,
        )
        if isinstance(transport, ShmLink):
            release_after = device_kwargs.pop("release_after", 0.0)
            self.device = ShmDevice(
                transport, options, device_kwargs.pop("poll_window", 0.0),
                releaser(release_after) if release_after else None,
                device_kwargs.pop("budget", None), device_kwargs.pop("rendezvous_bytes", 0),
                frame_memory(release_after) if release_after else None,
            )
        assert not device_kwargs, f"unknown device options {device_kwargs}"
        if transport is not None:
            self.engine.add(self.device)

    def attach(self, device):
        self.device = device
        self.engine.add(device)

    def send(self, vc, unit, token=None):
        """Post ``unit``, as the parcelport does without aggregation; True when
        the fabric took all of it at once."""
        self.device.post(vc, unit, token)
        return not self.device.queued_bytes

    def _handle(self, batch):
        self.events.extend(event for _, event in batch)
        self.arrived.set()

    async def wait_for(self, predicate, timeout=10):
        async def wait():
            while not predicate(self.events):
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(wait(), timeout)

    def close(self):
        if self.device is not None:
            self.engine.remove(self.device)
        self.engine.close()


#: The two ends of a device of each message fabric, made in one process.
_FABRIC_DEVICES = {
    "ucx": ucx_devices,
    "ofi": ofi_devices,
    "memory": lambda loop, ends: fabric_devices(loop, ends, "memory", MemoryFabric),
}


def _fabric_devices(provider, loop, ends, sndbuf):
    if provider != "tcp":
        return _FABRIC_DEVICES[provider](loop, ends)
    devices = fabric_devices(loop, ends, "tcp", lambda loop, engine: ListeningTcpFabric(loop, engine, sndbuf))
    if sndbuf:
        for device in devices:
            device.peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    return devices


@pytest.fixture
def endpoint_pair():
    """``with endpoint_pair(mode, **kwargs) as (a, b)``: two connected endpoints."""

    @contextlib.contextmanager
    def make(mode="loop", sndbuf=None, provider="tcp", pool=None, **kwargs):
        """With ``provider="shm"``, ``sndbuf`` is the ring size and large
        frames go through the ring unless a ``pool`` is given explicitly (or
        are read from the sender from ``rendezvous_bytes`` on);
        with ``"tcp"`` it is each socket's send and receive buffer; with
        another message fabric (``"ucx"``, ``"ofi"``, ``"memory"``) it has no
        effect."""
        loop = asyncio.get_running_loop()
        socks = []
        transports = [None, None]
        if provider == "shm":
            socks = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for s in socks:
                s.setblocking(False)
            if pool is None:
                pool = 0 if sndbuf else 64 << 20
            transports = shm_links(socks, shm_segment.Layout(sndbuf or 1 << 20, pool, 64),
                                   reads=bool(kwargs.get("rendezvous_bytes")))
        made = []
        try:
            for transport in transports:
                made.append(Endpoint(loop, transport, mode, **kwargs))
            if provider != "shm":
                devices = _fabric_devices(provider, loop, made, sndbuf)
                for end, device in zip(made, devices, strict=True):
                    end.attach(device)
            yield made
        finally:
            for endpoint in made:
                endpoint.close()
            for s in socks:
                s.close()

    return make


@pytest.fixture
def bare_end():
    """``bare_end()``: an endpoint with an engine and no device yet (a
    provider makes one with its options); closed after the test."""
    made = []

    def make(mode="loop"):
        made.append(Endpoint(asyncio.get_running_loop(), None, mode))
        return made[-1]

    yield make
    for end in made:
        end.close()


def shm_links(socks, layout, reads=False):
    """Two ends of a shared-memory device in one process: each end receives
    in a segment of its own and writes into a second mapping of the other's;
    with ``reads``, each reads the other's lent frames (from this process)."""
    segments = [shm_segment.create(layout) for _ in socks]
    regions = [region for _, region in segments]
    peers = [shm_segment.attach(fd, layout) for fd, _ in segments]
    for fd, _ in segments:
        os.close(fd)
    for region in regions:
        region.store(shm_segment.ASLEEP, 1)
    names = ["lci://a:1", "lci://b:2"]
    return [
        ShmLink(socks[i], peers[1 - i], layout, regions[i], layout, names[i], names[1 - i],
                os.getpid(), reads, reads)
        for i in range(2)
    ]
