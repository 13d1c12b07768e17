"""A process's endpoint on a tagged-message fabric, and its verbs.

LCI keeps one set of network resources per process and tells peers apart by
their addresses; its network layer gives every backend the same few verbs.
Here that set is one :class:`MessageFabric` per progress engine (a UCX
worker, say), with a peer handle per peer: a peer costs a handle, not
descriptors and threads of its own. A provider of such a fabric implements
the verbs alone (the abstract methods below); routes, the greeting, limits,
retirement and progress are this module's, and what a device does with
messages is :mod:`.message_device`'s, the same for every fabric.

Every message is a tagged send that no receive awaits (LCI's one-sided
puts): progress takes each message off the fabric's queue of unexpected
messages with its tag and length, and hands it to the device its tag routes
it to (:mod:`.message_tags`), which checks the length against its limits
before it allocates anything. Route 0 is the fabric's own: a HELLO there
asks a listener for a device, which answers with a WELCOME; anything else
there is a probe, dropped unread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from itertools import count
from typing import Any

import numpy as np

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.base import Device, Progress, SharedSource, connect_timeout
from dask_lcicomm.providers.message_routes import Answer, Listener, RoutedDevice
from dask_lcicomm.providers.message_tags import CONTROL, NUMBER_BITS, NUMBER_MASK
from dask_lcicomm.providers.message_verbs import DONE, Request, Rma

logger = logging.getLogger(__name__)

_MAX_HELLO_BYTES = 16 * 1024
#: Most messages taken from the fabric's queue in one pass.
_PROBES = 64
#: Progress calls in one pass before the fabric is armed (or left for later).
_PROGRESS_ROUNDS = 16
#: How long a closed device's peer handle may take to finish its sends.
_RETIRE_S = 10.0
#: How long progress waits to retry sends, if no event comes first: rxm
#: answers "retry" while its connection thread, which needs the endpoint's
#: lock, connects, and retrying at once kept that thread out until timeout.
_RETRY_S = 0.001


class MessageFabric(SharedSource):
    """One endpoint on the fabric, its routes and its listeners. Made by the
    engine (:meth:`Progress.shared`), which releases it once no listener and
    no device holds it. Subclasses implement the verbs, each called under
    :attr:`lock`."""

    #: The provider's name.
    provider: str
    #: This endpoint's address, as peers pass it to :meth:`open_peer`.
    address: str
    #: The verbs that read peers' memory, where the fabric has RMA.
    rma: Rma | None = None
    #: Whether :meth:`send` takes a list of buffers as one message, written
    #: from where they lie; else the device joins them first.
    gathers = False

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> None:
        self._loop = loop
        self._progress = progress
        #: Serialises every call into the fabric: sends come from the event
        #: loop, progress from wherever the engine runs it.
        self.lock = threading.Lock()
        self._routes: dict[int, RoutedDevice] = {}
        self._listeners: dict[int, Listener] = {}
        self._listener_ids = count(1)
        self._hellos: deque[tuple[Request, np.ndarray, Any]] = deque()
        #: Requests whose owner is gone, kept with their buffers until done.
        self._orphans: list[tuple[Request, Any]] = []
        #: Peer handles of closed devices, until their sends are done (or overdue).
        self._retiring: list[tuple[Any, list[tuple[Request, Any]], float]] = []
        #: Holds of closed peer handles, let go by :meth:`settle`.
        self._drops = 0
        #: Devices with sends or receives under way in the fabric.
        self._busy: set[RoutedDevice] = set()
        self._broken: set[RoutedDevice] = set()
        #: Devices with messages the fabric answered "retry" to.
        self._retrying: set[RoutedDevice] = set()
        self._armed = False
        self._released = False

    # -- the verbs -------------------------------------------------------

    @abstractmethod
    def open_peer(self, address: str) -> Any:
        """A handle for the endpoint at ``address``; the fabric's setup
        errors (:meth:`setup_errors`) when it cannot be reached."""

    def answering(self, message: Any, hello: dict[str, Any]) -> tuple[Any, Callable[[], Answer]]:
        """The listener a HELLO (taken as ``message``) asks for, and how to
        reach its sender: by default as the hello says, opening a handle by
        the sender's address. A fabric of connections answers over the one
        the hello came by."""
        return hello["listener"], lambda: (
            self.open_peer(str(hello["address"])), str(hello["peer"]), str(hello["local"]))

    @abstractmethod
    def watch_peer(self, peer: Any, failed: Callable[[], None]) -> None:
        """Have ``failed`` called (on any thread) once ``peer`` is unreachable."""

    @abstractmethod
    def close_peer(self, peer: Any) -> None:
        """Stop watching ``peer``, cancel what is left of its sends, free it."""

    @abstractmethod
    def send(self, peer: Any, tag: int, message: Any) -> Request | None:
        """Post ``message`` (a buffer; a list of buffers, sent as one
        message, where the fabric :attr:`gathers`) to ``peer`` with
        ``tag``; None when the fabric cannot take it now (retry after
        progress). The caller keeps ``message`` until the send is done."""

    @abstractmethod
    def take(self) -> tuple[int, int, Any, Any] | None:
        """The next message in the queue of unexpected ones, taken out of
        it: its tag, its length, a handle for :meth:`receive`, and its bytes
        where the fabric has them whole already (a writable buffer of the
        message's length: nothing to receive; LCI's medium messages), else
        None; None when there is none."""

    @abstractmethod
    def receive(self, message: Any, buffer: np.ndarray) -> Request:
        """Receive the taken ``message`` into ``buffer``; a shorter buffer
        truncates it."""

    @abstractmethod
    def poke(self) -> None:
        """Progress the fabric once, without waiting."""

    @abstractmethod
    def arm(self) -> bool:
        """Make :meth:`fileno` readable on the next event; False if an event
        is pending already (poke again first)."""

    @abstractmethod
    def cancel_all(self) -> None:
        """Cancel every request in flight and free the endpoint."""

    @staticmethod
    @abstractmethod
    def setup_errors() -> tuple[type[BaseException], ...]:
        """What opening a peer raises when the peer or fabric cannot do it:
        each means "not over this fabric with this peer", never a crash."""

    @property
    def retry_limit(self) -> float:
        """How long, in seconds, the fabric may answer "retry" to every send
        to a peer before that peer counts as unreachable: Dask's connect
        timeout, unless the fabric knows better."""
        return connect_timeout()

    # -- routes and listeners (under the lock) ----------------------------

    @property
    def input_pending(self) -> bool:
        return (not self._armed or bool(self._retrying)) and not self._released

    @property
    def retry_delay(self) -> float:
        return _RETRY_S if self._armed else 0.0

    def add(self, device: RoutedDevice) -> int:
        """A fresh route for ``device``."""
        route = 0
        while route == 0 or route in self._routes:
            route = secrets.randbits(32)
        self._routes[route] = device
        return route

    def remove(self, device: RoutedDevice, receives: Iterable[tuple[Request, np.ndarray]]) -> None:
        """``device`` is gone; the fabric may still write into its ``receives``."""
        if self._routes.get(device.route) is device:
            del self._routes[device.route]
        self._busy.discard(device)
        self._broken.discard(device)
        self._retrying.discard(device)
        self._orphans.extend(receives)

    def retire(self, peer: Any, sends: list[tuple[Request, Any]]) -> None:
        """Close the handle of a closed device once ``sends`` (requests and
        their buffers) are done, within :data:`_RETIRE_S`, and let go of the
        device's hold then: the fabric is progressed until its END is out
        (under the lock; :meth:`settle` after it)."""
        self._retiring.append((peer, sends, time.monotonic() + _RETIRE_S))
        self._close_retired()

    def _close_retired(self) -> None:
        now = time.monotonic()
        retiring = []
        for peer, sends, deadline in self._retiring:
            if all(request.completed for request, _ in sends) or now > deadline:
                self.close_peer(peer)
                self._drops += 1
            else:
                retiring.append((peer, sends, deadline))
        self._retiring = retiring

    def settle(self) -> None:
        """Let go of the holds of the peers closed since (not under the
        lock: the last one releases the fabric). Read first without the lock,
        as every progress pass calls it: whoever closes a peer settles
        after it, so a count another thread is adding is not missed."""
        if not self._drops:
            return
        with self.lock:
            drops, self._drops = self._drops, 0
        for _ in range(drops):
            self.drop()

    def drop(self) -> None:
        """A listener or device lets go of the fabric (not under the lock:
        the last one releases it)."""
        self._progress.drop(self)

    def busy(self, device: RoutedDevice) -> None:
        """The fabric has work of ``device`` under way: reap it on progress."""
        self._busy.add(device)

    def retry_later(self, device: RoutedDevice) -> None:
        """The fabric answered "retry" to ``device``: progress comes back
        after :data:`_RETRY_S` until it took the message (no event may say
        when). A released device closes with what it has, as the event loop
        that would retry may be closing too."""
        if device.released:
            return
        self._busy.add(device)
        if device not in self._retrying:
            self._retrying.add(device)
            self._progress.kick(self)

    def listen(self, listener: Listener) -> int:
        number = next(self._listener_ids)
        with self.lock:
            self._listeners[number] = listener
        return number

    def stop_listening(self, number: int) -> None:
        with self.lock:
            self._listeners.pop(number, None)

    def watch(self, peer: Any, device: RoutedDevice) -> None:
        """Report ``peer`` unreachable to ``device``."""
        self.watch_peer(peer, lambda: self._peer_failed(device))

    def _peer_failed(self, device: RoutedDevice) -> None:
        if self._routes.get(device.route) is device:
            device.peer_failed()
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
        """Progress the fabric and take what arrived; arm it before the
        engine sleeps on it (left unarmed, ``input_pending`` brings the engine
        back)."""
        news: set[Device] = set()
        with self.lock:
            if self._released:
                return news
            self._armed = False
            for _ in range(_PROGRESS_ROUNDS):
                self.poke()
                drained = self._take_arrivals(news)
                self._reap(news)
                if drained and self.arm():
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
            if not device.unposted:
                self._retrying.discard(device)
            if not device.busy:
                self._busy.discard(device)
        if self._orphans:
            self._orphans = [entry for entry in self._orphans if not entry[0].completed]
        if self._retiring:
            self._close_retired()
        if self._hellos:
            self._answer_hellos()

    def _answer_hellos(self) -> None:
        # What a malformed or unanswerable HELLO raises: it is ignored.
        ignored: tuple[type[BaseException], ...] = (KeyError, TypeError, *self.setup_errors())
        while self._hellos and self._hellos[0][0].completed:
            request, buffer, message = self._hellos.popleft()
            try:
                request.check_error()
                self._welcome(json.loads(buffer.tobytes()), message)
            except ignored as e:
                logger.info("ignoring a %s hello: %s: %s", self.provider, type(e).__name__, e)

    def _take_arrivals(self, news: set[Device]) -> bool:
        """Hand what arrived to the devices its tags route it to. False when
        messages may be left in the fabric's queue (no event says so: the
        fabric must not be armed)."""
        for _ in range(_PROBES):
            taken = self.take()
            if taken is None:
                return True
            value, nbytes, message, data = taken
            route, kind, number = value >> 32, (value >> NUMBER_BITS) & 3, value & NUMBER_MASK
            if route == 0:
                if kind == CONTROL:
                    self._take_hello(nbytes, message, data)
                else:
                    self._drop(nbytes, message, data)
                continue
            device = self._routes.get(route)
            if device is None:
                self._drop(nbytes, message, data)
                continue
            try:
                if device.arrived(kind, number, nbytes, message, data):
                    self._busy.add(device)
            except ProtocolError as e:
                self._drop(nbytes, message, data)
                device.violated(str(e))
            news.add(device)
        return False

    def _drop(self, nbytes: int, message: Any, data: Any) -> None:
        """Take a message nobody may have off the fabric, reading at most a
        few bytes of it (the fabric truncates the rest)."""
        if data is None:
            buffer = np.empty(min(nbytes, 8), np.uint8)
            self._orphans.append((self.receive(message, buffer), buffer))

    def _take_hello(self, nbytes: int, message: Any, data: Any) -> None:
        if nbytes > _MAX_HELLO_BYTES:
            logger.warning("dropping a %d-byte %s hello", nbytes, self.provider)
            self._drop(nbytes, message, data)
            return
        if data is not None:
            self._hellos.append((DONE, np.frombuffer(data, np.uint8), message))
            return
        buffer = np.empty(nbytes, np.uint8)
        self._hellos.append((self.receive(message, buffer), buffer, message))

    def _welcome(self, hello: dict[str, Any], message: Any) -> None:
        """Make the device a HELLO asks for and answer (under the lock)."""
        number, answer = self.answering(message, hello)
        listener = self._listeners.get(number)
        route = hello["route"]
        if listener is None or not (isinstance(route, int) and 0 < route < 1 << 32):
            raise ValueError(f"no listener {number!r} or a bad route {route!r}")
        if not self._progress.hold(self):
            raise ValueError(f"the {self.provider} fabric is closing")
        try:
            peer, local, remote = answer()
        except BaseException:
            self._loop.call_soon_threadsafe(self.drop)
            raise
        device = listener.make(peer, route, local, remote)
        device.welcome()
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
            for peer, _, _ in self._retiring:
                self.close_peer(peer)
            self._retiring.clear()
            # Requests left hold the endpoint: cancel them, then let it go.
            self.cancel_all()
            self._orphans.clear()
            self._hellos.clear()
            self._listeners.clear()

