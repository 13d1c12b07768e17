"""The message-fabric verbs over libfabric: one reliable-datagram endpoint
(``FI_EP_RDM``) per progress engine, its peers in one address vector, tagged
sends, and libfabric's queue of unexpected messages read by peek-and-claim
(see :mod:`.message_fabric` for what is done with them).

Every send, receive and read completes through the endpoint's one
completion queue, whose wait descriptor the engine sleeps on (``fi_trywait``
first). Where the libfabric provider has RMA, large bulk groups are read by
the receiver from memory the sender registered (:mod:`.message_rendezvous`),
unless ``rendezvous-bytes`` is 0.

libfabric reports no peer's death by itself: a send to a dead peer fails,
or is answered "retry" while the fabric tries to connect again. While
devices are open, each of their peer endpoints is sent an empty probe every
``probe-interval``, which the peer drops unread; a probe that fails, or
that is answered "retry" for ``unreachable-after``, reports every device of
that peer lost. Once the endpoint took a send to the peer, "retry" may be
the backpressure of a peer whose event loop is busy, and libfabric (1.17's
rxm) tells a dead peer from it by nothing else: then the bound is Dask's
TCP timeout, ``distributed.comm.timeouts.tcp``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from itertools import count
from typing import Any

import numpy as np

from dask_lcicomm.config import Settings
from dask_lcicomm.providers import _ofi
from dask_lcicomm.providers.base import Progress, dead_after
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_tags import PROBE
from dask_lcicomm.providers.message_verbs import Request
from dask_lcicomm.providers.ofi_options import OfiOptions

logger = logging.getLogger(__name__)

#: The id of the one peek in flight; operations count up from 1.
_PEEK = 0
#: Completions read in one call (the extension's batch).
_BATCH = 64
#: Tries of a receive or read the fabric answered "retry" to, progressing between.
_RECEIVE_TRIES = 1000


def open_endpoint(options: OfiOptions) -> _ofi.Endpoint:
    """An endpoint as ``options`` ask (``OSError`` naming libfabric's
    reason when there is none)."""
    return _ofi.Endpoint(options.provider, options.node, options.rendezvous_bytes > 0)


class _Request:
    """A send or receive, completed by the completion its id names (or by an
    error at once); ``on_error`` is told when it fails (a probe's)."""

    __slots__ = ("completed", "error", "on_error")

    def __init__(self, error: int = 0, on_error: Callable[[], None] | None = None) -> None:
        self.completed = bool(error)
        self.error = error
        self.on_error = on_error

    def check_error(self) -> None:
        if self.error:
            raise OSError(self.error, f"libfabric: {os.strerror(self.error)}")


class _Peer:
    """A device's handle on a peer endpoint; the endpoint's address-vector
    entry is shared by every device to it."""

    __slots__ = ("address", "at")

    def __init__(self, address: str, at: int) -> None:
        self.address = address
        self.at = at


class OfiFabric(MessageFabric):
    """A libfabric endpoint, progressed by reading its completion queue."""

    provider = "ofi"

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> None:
        super().__init__(loop, progress)
        options = OfiOptions.of(Settings.from_config())
        self._endpoint = open_endpoint(options)
        self._fd = self._endpoint.fileno()
        self.address = self._endpoint.name().hex()
        if self._endpoint.rma:
            self.rma = self
            self.rendezvous_bytes = options.rendezvous_bytes
        self._ids = count(_PEEK + 1)
        self._requests: dict[int, _Request] = {}
        #: Address-vector entries by address: [entry, devices using it].
        self._entries: dict[str, list[int]] = {}
        self._watched: dict[_Peer, Callable[[], None]] = {}
        self._peeking = False
        self._peeked: tuple[int, int, int, None] | None = None
        self._probe_interval = options.probe_interval
        self._retry_limit = options.unreachable_after
        self._probing = False
        #: Since when the fabric answered "retry" to every probe to a peer
        #: endpoint; those it took a send for, and how long they may refuse.
        self._refused: dict[int, float] = {}
        self._reached: set[int] = set()
        self._dead_after = dead_after()
        self._probe_timer: asyncio.TimerHandle | None = None

    def fileno(self) -> int:
        return self._fd

    @property
    def retry_limit(self) -> float:
        return self._retry_limit

    def open_peer(self, address: str) -> _Peer:
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = [self._endpoint.insert(bytes.fromhex(address)), 0]
        entry[1] += 1
        return _Peer(address, entry[0])

    def watch_peer(self, peer: _Peer, failed: Callable[[], None]) -> None:
        self._watched[peer] = failed
        if self._probe_interval and not self._probing:
            self._probing = True
            self._loop.call_soon_threadsafe(self._probe)

    def close_peer(self, peer: _Peer) -> None:
        self._watched.pop(peer, None)
        entry = self._entries[peer.address]
        entry[1] -= 1
        if not entry[1]:
            del self._entries[peer.address]
            self._refused.pop(entry[0], None)
            self._reached.discard(entry[0])
            self._endpoint.remove(entry[0])

    def send(self, peer: _Peer, tag: int, message: Any) -> Request | None:
        return self._send(peer.at, tag, message, None)

    def _send(self, at: int, tag: int, message: Any, on_error: Callable[[], None] | None) -> _Request | None:
        number = next(self._ids)
        try:
            # libfabric's "retry" asks for progress first: its queues may be
            # full of completions no one read (a writer that does not yield
            # leaves progress to its sends).
            if not self._endpoint.send(message, at, tag, number):
                self.poke()
                if not self._endpoint.send(message, at, tag, number):
                    return None
            self._reached.add(at)
        except OSError as e:
            if on_error is not None:
                on_error()
            return _Request(e.errno or errno.EIO)
        request = self._requests[number] = _Request(on_error=on_error)
        return request

    def take(self) -> tuple[int, int, Any, Any] | None:
        if self._peeked is None and not self._peeking:
            if not self._endpoint.peek(_PEEK):
                return None
            self._peeking = True
            self.poke()
        taken, self._peeked = self._peeked, None
        return taken

    def receive(self, message: Any, buffer: np.ndarray) -> Request:
        return self._post(lambda number: self._endpoint.receive(buffer, number, message), "receive")

    def register(self, buffer: Any) -> tuple[Any, int, int]:
        return self._endpoint.register(buffer)

    def unregister(self, handle: Any) -> None:
        self._endpoint.unregister(handle)

    def read(self, peer: _Peer, buffer: np.ndarray, address: int, key: int) -> Request:
        try:
            return self._post(lambda number: self._endpoint.read(buffer, peer.at, address, key, number),
                              "read")
        except OSError as e:  # the address and key are the peer's word
            return _Request(e.errno or errno.EIO)

    def _post(self, post: Callable[[int], bool], what: str) -> _Request:
        """A receive or read ``post`` posts with the id it is given,
        progressing while the fabric answers "retry"."""
        number = next(self._ids)
        for _ in range(_RECEIVE_TRIES):
            if post(number):
                request = self._requests[number] = _Request()
                return request
            self.poke()
        raise OSError(11, f"libfabric took no {what} in {_RECEIVE_TRIES} tries")

    def poke(self) -> None:
        while True:
            events = self._endpoint.poll()
            for number, nbytes, tag, error, claim in events:
                if number == _PEEK:
                    self._peeking = False
                    if not error:
                        self._peeked = (tag, nbytes, claim, None)
                    elif error != _ofi.ENOMSG:
                        logger.warning("libfabric failed a peek: %s", os.strerror(error))
                    continue
                request = self._requests.pop(number, None)
                if request is not None:
                    request.completed, request.error = True, error
                    if error and request.on_error is not None:
                        request.on_error()
            if len(events) < _BATCH:
                return

    def arm(self) -> bool:
        return bool(self._endpoint.trywait())

    def _probe(self) -> None:
        """Send each watched peer endpoint a probe (on the event loop)."""
        with self.lock:
            if self._released or not self._watched:
                self._probing = False
                self._probe_timer = None
                return
            now = time.monotonic()
            for at in {peer.at for peer in self._watched}:
                if self._send(at, PROBE, b"", functools.partial(self._lost, at)) is not None:
                    self._refused.pop(at, None)
                elif now - self._refused.setdefault(at, now) > (
                    self._dead_after if at in self._reached else self._retry_limit
                ):
                    self._lost(at)
            self._probe_timer = self._loop.call_later(self._probe_interval, self._probe)
        self._progress.kick(self)

    def _lost(self, at: int) -> None:
        self._refused.pop(at, None)
        for peer, failed in list(self._watched.items()):
            if peer.at == at:
                failed()

    def cancel_all(self) -> None:
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        self._endpoint.close()
        self._requests.clear()
        self._watched.clear()

    @staticmethod
    def setup_errors() -> tuple[type[BaseException], ...]:
        return (OSError, ValueError)
