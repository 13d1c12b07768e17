"""Shared fixtures: devices over a socket pair, progressed by a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from dask_lcicomm.parcel import Limits
from dask_lcicomm.progress import ProgressEngine, make_completion
from dask_lcicomm.providers.tcp import TcpDevice


class Endpoint:
    """A device, its engine and everything its completion object delivered."""

    def __init__(self, loop, sock, mode, completion="queue", accepting=False, **device_kwargs):
        self.events: list = []
        self.arrived = asyncio.Event()
        self.completion = make_completion(
            completion, loop, self._handle, threadsafe=mode == "thread"
        )
        self.engine = ProgressEngine(loop, mode, self.completion, poll_interval=0.001)
        kwargs = {"limits": Limits(), "batch_bytes": 1 << 20}
        kwargs.update(device_kwargs)
        self.device = TcpDevice(
            sock,
            completion=self.completion,
            want_write=self.engine.want_write,
            accepting=accepting,
            **kwargs,
        )
        self.engine.add(self.device)

    def send(self, vc, unit, token=None):
        """Queue ``unit`` and flush, as the parcelport does without aggregation."""
        self.device.put(vc, unit, token)
        return self.device.flush()

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
        self.engine.remove(self.device)
        self.engine.close()


@pytest.fixture
def endpoint_pair():
    """``with endpoint_pair(mode, **kwargs) as (a, b)``: two connected endpoints."""

    @contextlib.contextmanager
    def make(mode="loop", sndbuf=None, **kwargs):
        loop = asyncio.get_running_loop()
        socks = socket.socketpair()
        for s in socks:
            s.setblocking(False)
            if sndbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        made = []
        try:
            for s in socks:
                made.append(Endpoint(loop, s, mode, **kwargs))
            yield made
        finally:
            for endpoint in made:
                endpoint.close()
            for s in socks:
                s.close()

    return make
