"""What tests of message fabrics share: a fabric inside one process, for
testing what every message fabric shares (:mod:`dask_lcicomm.providers.message_fabric`
and ``message_device``) where no real one is installed, also as an lci://
provider called ``memory`` (:func:`install_memory_provider`); two ends of a
device in one process; a send that does not follow the protocol.

It behaves as a tagged-message fabric does: a send lands in the receiver's
queue of unexpected messages and wakes it through its descriptor; a message
over :data:`EAGER_BYTES` completes at its sender only once the receiver has
taken it (a rendezvous), a smaller one at once; the first
:attr:`MemoryFabric.connect_retries` sends to a new peer answer "retry", as
a fabric that connects on first use does; a receive into a shorter buffer
truncates; an endpoint that closes fails the handles peers hold for
it and the sends still waiting in its queue. It has RMA: a peer reads memory
an endpoint registered, by an address and key that must name it exactly,
for groups of :attr:`MemoryFabric.rendezvous_bytes` and more (groups of
1 MiB, the default send batch, up to that are still sent).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import itertools
import os
import secrets
import socket
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.providers.base import DeviceLost
from dask_lcicomm.providers.message_device import MessageDevice
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_provider import MessageProvider
from dask_lcicomm.providers.message_routes import Listener
from dask_lcicomm.providers.message_tags import tag
from dask_lcicomm.providers.tcp_fabric import TcpFabric

#: Messages up to this size complete at their sender at once.
EAGER_BYTES = 8192

#: Open endpoints by address.
_endpoints: dict[str, MemoryFabric] = {}
#: Peer handles by the address they lead to.
_handles: dict[str, list[_Peer]] = {}
_registry = threading.Lock()


class _Request:
    __slots__ = ("completed", "error")

    def __init__(self, completed: bool = False, error: BaseException | None = None) -> None:
        self.completed = completed
        self.error = error

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Message:
    __slots__ = ("tag", "data", "sent", "sender")

    def __init__(self, tag: int, data: bytes, sent: _Request, sender: MemoryFabric) -> None:
        self.tag = tag
        self.data = data
        self.sent = sent
        self.sender = sender


class _Peer:
    __slots__ = ("address", "owner", "failed", "retries")

    def __init__(self, address: str, owner: MemoryFabric) -> None:
        self.address = address
        self.owner = owner
        self.failed: Callable[[], None] | None = None
        self.retries = owner.connect_retries

    def fail(self) -> None:
        if self.failed is not None:
            self.failed()
            self.owner.wake()


class MemoryFabric(MessageFabric):
    provider = "memory"
    #: Sends to a new peer that answer "retry" before the first is taken.
    connect_retries = 3
    rendezvous_bytes = 2 << 20

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.address = secrets.token_hex(8)
        self.rma = self
        #: Memory peers may read, by key; a region's address is its key << 32.
        self.regions: dict[int, memoryview] = {}
        self._keys = itertools.count(1)
        self._queue: deque[_Message] = deque()
        # Guards the queue, and the wake-up pipe against its closing: other
        # fabrics deliver and wake from their own threads.
        self._queue_lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        with _registry:
            _endpoints[self.address] = self

    def fileno(self) -> int:
        return self._wake_r

    def wake(self) -> None:
        with self._queue_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # full: a wake-up is pending anyway

    def open_peer(self, address: str) -> Any:
        with _registry:
            if address not in _endpoints:
                raise ConnectionRefusedError(f"no memory endpoint {address!r}")
            peer = _Peer(address, self)
            _handles.setdefault(address, []).append(peer)
        return peer

    def watch_peer(self, peer: Any, failed: Callable[[], None]) -> None:
        peer.failed = failed

    def close_peer(self, peer: Any) -> None:
        peer.failed = None
        with _registry:
            handles = _handles.get(peer.address, [])
            if peer in handles:
                handles.remove(peer)

    def send(self, peer: Any, tag: int, message: Any) -> _Request | None:
        if peer.retries:
            peer.retries -= 1
            return None
        data = bytes(memoryview(message).cast("B"))
        sent = _Request(completed=len(data) <= EAGER_BYTES)
        with _registry:
            target = _endpoints.get(peer.address)
        if target is None or not target.deliver(_Message(tag, data, sent, self)):
            return _Request(True, ConnectionResetError("the peer endpoint is closed"))
        return sent

    def deliver(self, message: _Message) -> bool:
        """Queue ``message``; False if this endpoint has closed."""
        with self._queue_lock:
            if self._closed:
                return False
            self._queue.append(message)
        self.wake()
        return True

    def register(self, buffer: Any) -> tuple[int, int, int]:
        key = next(self._keys)
        self.regions[key] = memoryview(buffer).cast("B")
        return key, key << 32, key

    def unregister(self, handle: int) -> None:
        del self.regions[handle]

    def read(self, peer: Any, buffer: np.ndarray, address: int, key: int) -> _Request:
        with _registry:
            target = _endpoints.get(peer.address)
        region = None if target is None else target.regions.get(key)
        offset = address - (key << 32)
        if region is None or offset < 0 or offset + buffer.nbytes > region.nbytes:
            return _Request(True, PermissionError(f"no registered memory at {address:#x} with key {key}"))
        buffer[:] = np.frombuffer(region[offset : offset + buffer.nbytes], np.uint8)
        return _Request(completed=True)

    def take(self) -> tuple[int, int, Any, Any] | None:
        with self._queue_lock:
            if not self._queue:
                return None
            message = self._queue.popleft()
        return message.tag, len(message.data), message, None

    def receive(self, message: Any, buffer: np.ndarray) -> _Request:
        n = min(len(message.data), buffer.nbytes)
        buffer[:n] = np.frombuffer(message.data, np.uint8, n)
        if not message.sent.completed:
            message.sent.completed = True
            message.sender.wake()
        return _Request(completed=True)

    def poke(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def arm(self) -> bool:
        with self._queue_lock:
            return not self._queue

    def cancel_all(self) -> None:
        with _registry:
            del _endpoints[self.address]
            handles = _handles.pop(self.address, [])
        with self._queue_lock:
            self._closed = True
            left, self._queue = list(self._queue), deque()
            os.close(self._wake_r)
            os.close(self._wake_w)
        for message in left:
            if not message.sent.completed:
                message.sent.error = ConnectionResetError("the peer endpoint closed")
                message.sent.completed = True
                message.sender.wake()
        for peer in handles:
            peer.fail()

    @staticmethod
    def setup_errors() -> tuple[type[BaseException], ...]:
        return (OSError, ValueError)


class MemoryProvider(MessageProvider):
    """The in-process fabric as an lci:// provider: listeners and comms of
    one process (one parcelport or several) reach each other over it."""

    name = "memory"

    def make_fabric(self, loop, progress) -> MemoryFabric:
        return MemoryFabric(loop, progress)


def install_memory_provider() -> None:
    """Make ``memory`` a provider that ``distributed.comm.lci.providers`` may
    name, for this process: a module ``dask_lcicomm.providers.memory``, as
    the registry finds providers."""
    name = "dask_lcicomm.providers.memory"
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.PROVIDER = MemoryProvider()  # type: ignore[attr-defined]
    sys.modules[name] = module


def fabric_devices(loop, ends, name: str, make: Callable[..., MessageFabric]) -> list[MessageDevice]:
    """Two ends of a message device in one process, each on the fabric
    endpoint of its own end's engine (``end.engine``, ``end.options``),
    welcomed by hand."""
    fabrics = [end.engine.shared(name, lambda end=end: make(loop, end.engine)) for end in ends]
    devices = []
    for i, (end, fabric) in enumerate(zip(ends, fabrics, strict=True)):
        with fabric.lock:
            peer = fabric.open_peer(fabrics[1 - i].address)
            devices.append(MessageDevice(
                fabric, peer, 0, end.options, f"lci://{'ab'[i]}:1", f"lci://{'ba'[i]}:1"
            ))
    devices[0]._outbox.route, devices[1]._outbox.route = devices[1].route, devices[0].route
    return devices


class ListeningTcpFabric(TcpFabric):
    """A tcp fabric endpoint listening on loopback, reached by its address
    (``open_peer``). Its listener makes no devices (hellos to it are
    dropped): devices are welcomed by hand, so the connections it accepts
    are kept without one. ``rcvbuf``: the receive buffer of each."""

    def __init__(self, loop, engine, rcvbuf: int | None = None) -> None:
        super().__init__(loop, engine)
        _, (host, port) = self.bind_listener(Listener(_no_device, _no_device), "127.0.0.1", 0)
        self.address = f"{host}:{port}"
        if rcvbuf:
            for sock, *_ in self._listening.values():
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)

    def _expire(self, connection: Any) -> None:
        pass


def _no_device(*args: Any) -> Any:
    raise ValueError("no listener here")


def lost(events):
    """The DeviceLost events among ``events``."""
    return [e for e in events if isinstance(e, DeviceLost)]


async def raw_send(sender, data: bytes, route: int, kind: int, number: int, peer=None) -> None:
    """Send ``data`` with the given tag to ``sender``'s peer (or to ``peer``,
    a handle of its fabric), as a peer that does not follow the protocol
    would; while the fabric answers "retry" (a new peer), the event loop
    runs the progress both ends need to connect."""
    fabric = sender.device.source
    deadline = time.monotonic() + 10
    while True:
        with fabric.lock:
            request = fabric.send(peer or sender.device.peer, tag(route, kind, number), data)
            if request is not None:
                if not request.completed:
                    fabric._orphans.append((request, data))
                return
            fabric.poke()
        assert time.monotonic() < deadline, "the fabric never took the message"
        await asyncio.sleep(0.001)
