"""One TCP connection of the tcp fabric (:mod:`.tcp_fabric`): messages framed
over a socket, in both directions, without the endpoint that polls it.

Each end writes an 8-byte preface first, so that a peer that is not an
``lci://`` endpoint (a ``tcp://`` listener, a port scanner) is told at once,
not at a timeout. A message is a 16-byte header (tag, length; little-endian)
and its bytes. Sends queued behind a full socket leave gathered, in few
writes. What arrives is read into a staging buffer, from which headers and
small messages are taken, a message staged whole with its bytes; a receive
copies what is staged and reads the rest of its message straight into its
buffer, so a large one is copied by nobody but the kernel. A message taken
without its bytes is read on only once received, and nothing is allocated by
a length read off the wire.
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.providers import message_verbs
from dask_lcicomm.providers.send_queue import IOV_MAX

HEADER = struct.Struct("<QQ")
#: Messages up to this size are copied behind their header, to write one buffer.
_JOINED_BYTES = 4096
PREFACE = b"LCI-TCP\x01"
#: Bytes a connection reads at once when no receive wants them.
_STAGE_BYTES = 32 * 1024
#: A receive reads at least this much of its message straight into its
#: buffer; a smaller rest comes through the stage, with what follows it.
_DIRECT_BYTES = 8 * 1024
#: Reads per call, so that one busy peer does not hold the others up.
_READS = 16
_NO_BUFFERS: deque[memoryview] = deque()


class NotAnEndpoint(ConnectionAbortedError):
    """The peer began with something else than the preface."""


def _advance(buffers: deque[memoryview], n: int) -> int:
    """Drop the first ``n`` bytes of ``buffers``; what is left of ``n`` once
    all are gone."""
    while buffers:
        head = buffers[0]
        if n < head.nbytes:
            buffers[0] = head[n:]
            return 0
        n -= head.nbytes
        buffers.popleft()
    return n


class Request:
    """A send (of ``buffers``) or a receive: done once ``completed``;
    ``error`` if it failed."""

    __slots__ = ("buffers", "completed", "error")

    def __init__(self, buffers: deque[memoryview] = _NO_BUFFERS) -> None:
        self.buffers = buffers
        self.completed = False
        self.error: BaseException | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(self, error: BaseException) -> None:
        if not self.completed:
            self.error = error
            self.completed = True


class Connection:
    """A socket to a peer. ``taken(tag, nbytes, connection, data)`` hears of
    each message whose header arrived: with its bytes (``data``) if they
    came with it, else (``data`` None) the message is received with
    :meth:`receive` before anything after it is read. Reading and writing
    raise what the socket raises, and :class:`NotAnEndpoint`; the owner
    closes the connection then (:meth:`fail`)."""

    def __init__(
        self, sock: socket.socket, taken: Callable[[int, int, Connection, bytearray | None], None]
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self._taken = taken
        self.sends: deque[Request] = deque((Request(deque((memoryview(PREFACE),))),))
        self._stage = bytearray(_STAGE_BYTES)
        self._staged = memoryview(self._stage)
        self._start = 0  # staged bytes not yet taken: stage[start:end]
        self._end = 0
        self._preface = True
        #: The length of the message taken and not yet received, or being
        #: received (its handle is the connection).
        self.incoming: int | None = None
        self._target: memoryview | None = None
        self._filled = 0
        self._skip = 0  # bytes of the message beyond the receive's buffer
        self._receiving: Request | None = None
        #: What the owner keeps: who to tell of a failure, how many hold it,
        #: the listener it came to, the events it is polled for.
        self.watchers: list[Callable[[], None]] = []
        self.handles = 0
        self.listener: int | None = None
        self.events = 0
        self.error: BaseException | None = None
        #: What a receive found wrong with the connection, for the owner.
        self.broken: OSError | None = None

    # -- sending ---------------------------------------------------------

    def send(self, tag: int, message: Any) -> message_verbs.Request:
        """Queue ``message`` (a buffer, or a list of buffers written as one
        message, gathered) behind the sends before it; with none before it,
        write it at once: a send the socket took whole is done."""
        buffers: tuple[memoryview, ...]
        if type(message) is bytes and len(message) <= _JOINED_BYTES:
            # A small message costs less joined to its header than gathered.
            buffers = (memoryview(HEADER.pack(tag, len(message)) + message),)
            total = HEADER.size + len(message)
        else:
            if type(message) is list:
                parts = [view for m in message if (view := memoryview(m).cast("B"))]
            else:
                parts = [memoryview(message).cast("B")]
            nbytes = sum(map(len, parts))
            header = memoryview(HEADER.pack(tag, nbytes))
            buffers = (header, *parts) if nbytes else (header,)
            total = HEADER.size + nbytes
        if self.error is not None:
            request = Request()
            request.fail(self.error)
            return request
        n = 0
        if not self.sends and len(buffers) <= IOV_MAX:
            try:
                n = self.sock.sendmsg(buffers)
            except OSError:
                pass  # write() meets it again, and the owner closes the connection then
            if n == total:
                return message_verbs.DONE
        request = Request(deque(buffers))
        _advance(request.buffers, n)
        self.sends.append(request)
        return request

    def write(self) -> None:
        """Write the queued sends, gathered, as far as the socket takes them."""
        sends = self.sends
        while sends:
            iov: list[memoryview] = []
            for request in sends:
                iov.extend(request.buffers)
                if len(iov) >= IOV_MAX:
                    break
            del iov[IOV_MAX:]
            try:
                n = self.sock.sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                return
            # Bytes views all (cast to "B"): their len is their size.
            full = n < sum(map(len, iov))
            while n:
                n = _advance(sends[0].buffers, n)
                if not sends[0].buffers:
                    sends.popleft().completed = True
            if full:
                return

    # -- receiving -------------------------------------------------------

    @property
    def _staged_bytes(self) -> int:
        return self._end - self._start

    def receive(self, buffer: np.ndarray) -> Request:
        """Receive the message taken into ``buffer``; a shorter one truncates it."""
        assert self.incoming is not None
        request = Request()
        if self.error is not None:
            request.fail(self.error)
            return request
        self._target = memoryview(buffer.data).cast("B")[: self.incoming]
        self._filled = 0
        self._skip = self.incoming - self._target.nbytes
        self._receiving = request
        # What is staged first, then whatever the socket has.
        try:
            self._fill()
            if not request.completed:
                self.read()
        except OSError as e:
            self.broken = e
        return request

    def read(self) -> None:
        """Read what the socket has: into the message being received, or
        into the stage, and take what is staged."""
        sock = self.sock
        for _ in range(_READS):
            if self.error is not None:
                return
            target = self._target
            try:
                if target is not None and target.nbytes - self._filled >= _DIRECT_BYTES:
                    n = sock.recv_into(target[self._filled :])
                    if n:
                        self._filled += n
                        self._check_received()
                        continue
                else:
                    if self.incoming is not None and target is None:
                        return  # taken, not yet received: its receive reads on
                    if self._start == self._end:
                        self._start = self._end = 0
                    elif self._end == len(self._stage):
                        staged = self._staged_bytes
                        self._stage[:staged] = self._staged[self._start : self._end]
                        self._start, self._end = 0, staged
                    space = len(self._stage) - self._end
                    n = sock.recv_into(self._staged[self._end :])
                    if n:
                        self._end += n
                        self._fill()
                        if n < space:
                            return  # drained: the next event says when there is more
                        continue
            except (BlockingIOError, InterruptedError):
                return
            raise ConnectionResetError("the peer closed the connection")

    def _fill(self) -> None:
        """Give the message being received what is staged of it, then take
        the next message staged."""
        target = self._target
        if target is not None:
            n = min(target.nbytes - self._filled, self._staged_bytes)
            if n:
                start, filled = self._start, self._filled
                target[filled : filled + n] = self._staged[start : start + n]
                self._filled += n
                self._start += n
            self._check_received()
        if self.incoming is None:
            self._parse()

    def _check_received(self) -> None:
        target = self._target
        if target is None or self._filled < target.nbytes:
            return
        if self._skip:
            # The receive's buffer is full: the rest of the message is dropped.
            skip = min(self._skip, self._staged_bytes)
            self._skip -= skip
            self._start += skip
            if self._skip:
                self._target = memoryview(bytearray(min(self._skip, _STAGE_BYTES)))
                self._filled = 0
                self._skip -= self._target.nbytes
                return
        request = self._receiving
        self._target = self._receiving = self.incoming = None
        if request is not None:
            request.completed = True
        self._parse()

    def _parse(self) -> None:
        """Take the messages staged: each staged whole with its bytes, up to
        the first that is not and cannot be (larger than the stage), which is
        received before the next."""
        if self._preface:
            if self._staged_bytes < len(PREFACE):
                return
            start = self._start
            if self._stage[start : start + len(PREFACE)] != PREFACE:
                raise NotAnEndpoint(f"it began {bytes(self._stage[start : start + 8])!r}, "
                                    "not an lci:// endpoint's preface")
            self._start += len(PREFACE)
            self._preface = False
        while self.incoming is None and self._end - self._start >= HEADER.size:
            tag, nbytes = HEADER.unpack_from(self._stage, self._start)
            start = self._start + HEADER.size
            if nbytes > self._end - start:
                if HEADER.size + nbytes <= len(self._stage):
                    return  # staged whole once the rest is read: cheaper than a receive
                self._start = start
                self.incoming = nbytes
                self._taken(tag, nbytes, self, None)
                return
            # Staged whole (so no larger than the stage): taken with its bytes.
            self._start = start + nbytes
            self._taken(tag, nbytes, self, bytearray(self._staged[start : self._start]))

    # -- failure ---------------------------------------------------------

    def fail(self, error: BaseException) -> bool:
        """Fail what is under way with ``error`` and tell the watchers;
        False if the connection had failed already."""
        if self.error is not None:
            return False
        self.error = error
        for request in self.sends:
            request.fail(error)
        self.sends.clear()
        if self._receiving is not None:
            self._receiving.fail(error)
        for failed in self.watchers:
            failed()
        self.watchers.clear()
        return True
