"""The UCX worker that all ucx devices of a progress engine share.

LCI keeps one set of network resources per process and tells peers apart by
their addresses. Here that set is one UCX worker per progress engine, with
one UCX endpoint per peer: a peer costs an endpoint, not a worker with its
descriptors and threads.

Every message is a tagged send that no receive awaits (LCI's one-sided
puts): progress probes UCX's queue of unexpected messages, reads each one's
tag and length, and hands it to the device its tag routes it to, which checks
the length against its limits before it allocates anything.

A tag's high 32 bits are its route (:mod:`.ucx_context`): a random number
that the receiving device chose and told its peer alone, in the welcome
below. A peer therefore knows the routes of its
own devices only: it cannot put a message into another peer's conversation
except by guessing 32 random bits, and a message whose route no device holds
is dropped unread.

Route 0 belongs to the worker. A HELLO there asks a listener for a device. It
carries the connecting worker's address, the listener's number (from its
offer) and the route to answer on. The acceptor makes the device and an
endpoint back, and answers on that route with a WELCOME that carries its own
route.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import struct
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.base import Device, Progress, SharedSource
from dask_lcicomm.providers.ucx_context import (
    CONTROL,
    NUMBER_BITS,
    NUMBER_MASK,
    WELCOME,
    any_tag,
    array,
    bindings,
    new_worker,
    setup_errors,
    tag,
)

logger = logging.getLogger(__name__)

_ROUTE = struct.Struct("<I")
_MAX_HELLO_BYTES = 16 * 1024
#: Most messages taken from UCX's queue in one pass.
_PROBES = 64
#: Progress calls in one pass before the worker is armed (or left for later).
_PROGRESS_ROUNDS = 16
#: How long a closed device's endpoint may take to finish its sends.
_RETIRE_S = 10.0


@functools.cache
def _hello_errors() -> tuple[type[BaseException], ...]:
    """What a malformed or unanswerable HELLO raises: it is ignored."""
    return (KeyError, TypeError, *setup_errors())


class RoutedDevice(Device):
    """A device of the shared worker: what the worker asks of it. The worker
    calls these under its lock."""

    route: int

    @abstractmethod
    def arrived(self, kind: int, number: int, nbytes: int, probe: Any) -> None:
        """Receive the message ``probe`` found, or raise ``ProtocolError``
        before receiving anything."""

    @abstractmethod
    def reap(self) -> bool:
        """Take what UCX completed; True when the device has news."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether UCX has work of this device under way."""

    @abstractmethod
    def violated(self, reason: str) -> None:
        """The peer broke the protocol; the device is to be lost."""

    @abstractmethod
    def endpoint_failed(self) -> None:
        """UCX reports the endpoint to the peer broken."""


@dataclass(frozen=True)
class Listener:
    """A listener's part of the worker: how it makes and hands over devices."""

    #: ``make(endpoint, peer_route, local_address, peer_address)``.
    make: Callable[[Any, int, str, str], RoutedDevice]
    accepted: Callable[[Device], None]


class UcxWorker(SharedSource):
    """One UCX worker, its routes and its listeners. Made by the engine
    (:meth:`Progress.shared`), which releases it once no listener and no
    device holds it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> None:
        self._loop = loop
        self._progress = progress
        #: Serialises every call into UCX: sends come from the event loop,
        #: progress from wherever the engine runs it.
        self.lock = threading.Lock()
        self.worker = new_worker()
        self.address = self.worker.address.tobytes().hex()
        self._routes: dict[int, RoutedDevice] = {}
        self._listeners: dict[int, Listener] = {}
        self._listener_ids = count(1)
        self._hellos: deque[tuple[Any, np.ndarray]] = deque()
        #: Receives whose device is gone, kept with their buffers until UCX is done.
        self._orphans: list[tuple[Any, Any]] = []
        #: Endpoints of closed devices, until their sends are done (or overdue).
        self._retiring: list[tuple[Any, list[tuple[Any, Any]], float]] = []
        #: Holds of closed endpoints, let go by :meth:`settle`.
        self._drops = 0
        #: Devices with sends or receives under way in UCX.
        self._busy: set[RoutedDevice] = set()
        self._broken: set[RoutedDevice] = set()
        self._armed = False
        self._released = False

    def fileno(self) -> int:
        return int(self.worker.epoll_file_descriptor)

    @property
    def input_pending(self) -> bool:
        return not self._armed and not self._released

    # -- routes and listeners (under the lock) ----------------------------

    def add(self, device: RoutedDevice) -> int:
        """A fresh route for ``device``."""
        route = 0
        while route == 0 or route in self._routes:
            route = secrets.randbits(32)
        self._routes[route] = device
        return route

    def remove(self, device: RoutedDevice, receives: Iterable[tuple[Any, np.ndarray]]) -> None:
        """``device`` is gone; UCX may still write into its ``receives``."""
        if self._routes.get(device.route) is device:
            del self._routes[device.route]
        self._busy.discard(device)
        self._broken.discard(device)
        self._orphans.extend(receives)

    def retire(self, endpoint: Any, sends: list[tuple[Any, Any]]) -> None:
        """Close the endpoint of a closed device once ``sends`` (requests and
        their buffers) are done, within :data:`_RETIRE_S`, and let go of the
        device's hold then: the worker is progressed until its END is out
        (under the lock; :meth:`settle` after it)."""
        self._retiring.append((endpoint, sends, time.monotonic() + _RETIRE_S))
        self._close_retired()

    def _close_retired(self) -> None:
        now = time.monotonic()
        retiring = []
        for endpoint, sends, deadline in self._retiring:
            if all(request.completed for request, _ in sends) or now > deadline:
                # Cancels what is left of its sends.
                endpoint.close_blocking()
                self._drops += 1
            else:
                retiring.append((endpoint, sends, deadline))
        self._retiring = retiring

    def settle(self) -> None:
        """Let go of the holds of the endpoints closed since (not under the
        lock: the last one releases the worker). Read first without the lock,
        as every progress pass calls it: whoever closes an endpoint settles
        after it, so a count another thread is adding is not missed."""
        if not self._drops:
            return
        with self.lock:
            drops, self._drops = self._drops, 0
        for _ in range(drops):
            self.drop()

    def drop(self) -> None:
        """A listener or device lets go of the worker (not under the lock:
        the last one releases it)."""
        self._progress.drop(self)

    def busy(self, device: RoutedDevice) -> None:
        """UCX has work of ``device`` under way: reap it on progress."""
        self._busy.add(device)

    def listen(self, listener: Listener) -> int:
        number = next(self._listener_ids)
        with self.lock:
            self._listeners[number] = listener
        return number

    def stop_listening(self, number: int) -> None:
        with self.lock:
            self._listeners.pop(number, None)

    def endpoint(self, address: str) -> Any:
        """An endpoint to the worker at ``address`` (hex), reporting its
        failure (under the lock)."""
        return self.worker.create_endpoint_from_worker_address(
            bindings().UCXAddress.create_from_buffer(bytes.fromhex(address)), True
        )

    def watch_endpoint(self, endpoint: Any, device: RoutedDevice) -> None:
        endpoint.set_close_callback(functools.partial(self._endpoint_failed, device))

    def _endpoint_failed(self, device: RoutedDevice, *args: Any) -> None:
        device.endpoint_failed()
        self._broken.add(device)

    def hello(self, listener: int, route: int, local: str, peer: str) -> bytes:
        """The HELLO that asks the listener numbered ``listener`` for a
        device answering on ``route``; sent with route 0."""
        return json.dumps({
            "address": self.address, "listener": listener, "route": route,
            "local": local, "peer": peer,
        }).encode()

    # -- progress --------------------------------------------------------

    def progress(self) -> Iterable[Device]:
        """Progress the worker and take what arrived; arm it before the
        engine sleeps on it (left unarmed, ``input_pending`` brings the engine
        back)."""
        news: set[Device] = set()
        with self.lock:
            if self._released:
                return news
            worker = self.worker
            self._armed = False
            for _ in range(_PROGRESS_ROUNDS):
                worker.progress()
                drained = self._take_arrivals(news)
                self._reap(news)
                if drained and worker.arm():
                    self._armed = True
                    break
            news.update(self._broken)
            self._broken.clear()
        self.settle()
        return news

    def _reap(self, news: set[Device]) -> None:
        for device in list(self._busy):
            try:
                if device.reap():
                    news.add(device)
            except ProtocolError as e:
                device.violated(str(e))
                news.add(device)
            if not device.busy:
                self._busy.discard(device)
        if self._orphans:
            self._orphans = [entry for entry in self._orphans if not entry[0].completed]
        if self._retiring:
            self._close_retired()
        while self._hellos and self._hellos[0][0].completed:
            request, buffer = self._hellos.popleft()
            try:
                request.check_error()
                self._welcome(json.loads(buffer.tobytes()))
            except _hello_errors() as e:
                logger.info("ignoring a UCX hello: %s: %s", type(e).__name__, e)

    def _take_arrivals(self, news: set[Device]) -> bool:
        """Hand what arrived to the devices its tags route it to. False when
        messages may be left in UCX's queue (no event says so: the worker
        must not be armed)."""
        worker = self.worker
        tags = any_tag()
        for _ in range(_PROBES):
            probe = worker.tag_probe(*tags, remove=True)
            if not probe.matched:
                return True
            value = probe.sender_tag.value
            route, kind, number = value >> 32, (value >> NUMBER_BITS) & 3, value & NUMBER_MASK
            if route == 0:
                self._take_hello(probe)
                continue
            device = self._routes.get(route)
            if device is None:
                self._drop(probe)
                continue
            try:
                device.arrived(kind, number, probe.length, probe)
            except ProtocolError as e:
                self._drop(probe)
                device.violated(str(e))
            else:
                self._busy.add(device)
            news.add(device)
        return False

    def _drop(self, probe: Any) -> None:
        """Take a message nobody may have out of UCX's queue, reading at most
        a few bytes of it (UCX truncates the rest)."""
        buffer = np.empty(min(probe.length, 8), np.uint8)
        self._orphans.append((self.worker.tag_recv_with_handle(array(buffer), probe), buffer))

    def _take_hello(self, probe: Any) -> None:
        if probe.length > _MAX_HELLO_BYTES:
            logger.warning("dropping a %d-byte UCX hello", probe.length)
            self._drop(probe)
            return
        buffer = np.empty(probe.length, np.uint8)
        self._hellos.append((self.worker.tag_recv_with_handle(array(buffer), probe), buffer))

    def _welcome(self, hello: dict[str, Any]) -> None:
        """Make the device a HELLO asks for and answer (under the lock)."""
        listener = self._listeners.get(hello["listener"])
        route = hello["route"]
        if listener is None or not (isinstance(route, int) and 0 < route < 1 << 32):
            raise ValueError(f"no listener {hello['listener']!r} or a bad route {route!r}")
        if not self._progress.hold(self):
            raise ValueError("the worker is closing")
        try:
            endpoint = self.endpoint(str(hello["address"]))
        except BaseException:
            self._loop.call_soon_threadsafe(self.drop)
            raise
        device = listener.make(endpoint, route, str(hello["peer"]), str(hello["local"]))
        message = _ROUTE.pack(device.route)
        request = endpoint.tag_send(array(message), tag(route, CONTROL, WELCOME))
        if not request.completed:
            self._orphans.append((request, message))
        self._loop.call_soon_threadsafe(self._hand_over, listener, device)

    def _hand_over(self, listener: Listener, device: RoutedDevice) -> None:
        """Give the listener its device, on the event loop."""
        with self.lock:
            listening = listener in self._listeners.values() and not device.released
        if listening:
            listener.accepted(device)
        else:
            device.abandon()

    def release(self) -> None:
        with self.lock:
            if self._released:
                return
            self._released = True
            # The engine released the devices it had: these it never got.
            devices = list(self._routes.values())
        for device in devices:
            device.abandon()
        with self.lock:
            for endpoint, _, _ in self._retiring:
                endpoint.close_blocking()
            self._retiring.clear()
            # Requests left hold the worker: cancel them, then let it go.
            self.worker.cancel_inflight_requests()
            self._orphans.clear()
            self._hellos.clear()
            self._listeners.clear()
            self.worker = None


def peer_route(message: np.ndarray) -> int:
    """The route a WELCOME carries."""
    if message.nbytes != _ROUTE.size:
        raise ProtocolError(f"a {message.nbytes}-byte UCX welcome")
    (route,) = _ROUTE.unpack(message.tobytes())
    if route == 0:
        raise ProtocolError("a UCX welcome without a route")
    return int(route)
