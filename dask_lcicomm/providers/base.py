"""The device: one endpoint of a network channel, as a progress engine sees it.

A device moves parcels between two parcelports. Its verbs are ``put``, which
queues a parcel for a virtual connection, and ``flush``, which sends what is
queued on the calling thread as far as the fabric takes it without waiting;
what cannot be sent now is left to progress. On the receiving side progress
writes bytes where the parcel decoder says they belong and reports every
arrival to the completion object; nothing is ever received because someone
asked for it (LCI's one-sided model).

Sending interleaves the *units* of parcels (see :mod:`dask_lcicomm.parcel`)
of different virtual connections round-robin, one unit at a time, so a large
frame never holds small parcels of other comms behind it for its whole
length. Units that queued while the device was busy leave together, up to
``batch_bytes`` per system call (HPX's aggregation of parcels on a busy
connection).

A provider implements the transport primitives: :meth:`Device.fileno`,
:meth:`Device._transmit`, :meth:`Device._receive_into`,
:meth:`Device._shutdown` and :meth:`Device._close_transport`. A provider
whose ``fileno`` never becomes writable (shared memory: space in the peer's
ring is signalled through the readable side) sets ``watch_writable`` to False
and resumes blocked sends itself; one that stops reading early for fairness
with input left reports ``input_pending`` so that progress comes back to it.
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dask_lcicomm.parcel import Limits, ParcelDecoder, Placement, ProtocolError

if TYPE_CHECKING:
    from dask_lcicomm.progress.completion import Completion

logger = logging.getLogger("dask_lcicomm.providers")

IOV_MAX = 1024


class Unit(Protocol):
    """Something to send in units: :class:`~dask_lcicomm.parcel.OutgoingParcel` or raw bytes."""

    nbytes: int

    @property
    def done(self) -> bool: ...

    def next_unit(self) -> list[Any]: ...


class Raw:
    """A control message that goes out as one unit."""

    __slots__ = ("_data", "nbytes")

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self.nbytes = len(data)

    @property
    def done(self) -> bool:
        return self._data is None

    def next_unit(self) -> list[Any]:
        data, self._data = self._data, None
        return [data]


@dataclass(slots=True)
class SendDone:
    """The unit source queued with ``token`` has been handed to the fabric."""

    token: Any


@dataclass(slots=True)
class DeviceLost:
    """The device is gone; ``tokens`` are the sends that will never finish."""

    reason: str
    tokens: list[Any]


class DeviceClosed(ConnectionError):
    """A put on a device that is gone."""


def shut_socket(sock: socket.socket, both: bool) -> None:
    """End a socket's output (and input if ``both``), whatever state it is in."""
    try:
        sock.shutdown(socket.SHUT_RDWR if both else socket.SHUT_WR)
    except OSError:
        pass


class Device(ABC):
    """One endpoint of a channel between two parcelports."""

    provider: ClassVar[str]
    watch_writable: ClassVar[bool] = True

    def __init__(
        self,
        completion: Completion,
        want_write: Callable[[Device], None],
        limits: Limits,
        batch_bytes: int,
        accepting: bool,
        shard_bytes: int | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.completion = completion
        self._want_write = want_write
        self._decoder = ParcelDecoder(
            limits, require_connect=accepting, shard_bytes=shard_bytes, placement=placement
        )
        self._batch_bytes = batch_bytes
        self._lock = threading.Lock()
        self._streams: dict[int, deque[tuple[Unit, Any]]] = {}
        self._ready: deque[int] = deque()
        self._out: deque[Any] = deque()
        self._marks: deque[tuple[int, int, Any]] = deque()
        self._taken = 0
        self._sent = 0
        self._writing = False
        self._finishing = False
        self._lost: str | None = None
        self.released = False
        self.queued_bytes = 0
        self.index = 0
        self.local_address = ""
        self.peer_address = ""
        self.peer_info: dict[str, Any] = {}
        self.vcs: dict[int, Any] = {}
        self.listener: Any = None
        self.channel: Any = None

    @abstractmethod
    def fileno(self) -> int:
        """What the progress engine waits on."""

    @abstractmethod
    def _transmit(self, buffers: deque[Any]) -> int:
        """Send a prefix of ``buffers`` without blocking; return the byte count."""

    @abstractmethod
    def _receive_into(self, buffer: memoryview) -> int:
        """Receive into ``buffer`` without blocking; 0 means end of stream."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Release the transport; called once, by the progress engine."""

    @abstractmethod
    def _shutdown(self, both: bool) -> None:
        """End the output (and the input too if ``both``); the peer sees the end."""

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def input_pending(self) -> bool:
        """Whether :meth:`on_readable` left input that no readiness event will announce."""
        return False

    def put(self, vc: int, unit: Unit, token: Any = None) -> bool:
        """Queue ``unit`` on virtual connection ``vc``; :meth:`flush` sends it.

        Returns True when so much is queued that the caller should flush now
        rather than wait for more parcels to aggregate. A ``token`` comes
        back in a :class:`SendDone` completion once ``unit`` has been sent,
        or in :class:`DeviceLost` if it never will be.
        """
        with self._lock:
            if self._lost is not None or self._finishing:
                raise DeviceClosed(self._lost or "device is closing")
            stream = self._streams.get(vc)
            if stream is None:
                self._streams[vc] = stream = deque()
                self._ready.append(vc)
            stream.append((unit, token))
            self.queued_bytes += unit.nbytes
            return self.queued_bytes >= self._batch_bytes

    def flush(self) -> bool:
        """Send what is queued, on the calling thread, as far as the fabric
        takes it now; progress sends the rest. True when all is sent."""
        with self._lock:
            if self._writing:
                return False
            done = self._send()
            self._writing = not done
        if not done:
            self._want_write(self)
        return done

    def finish(self) -> None:
        """Send what is queued, then end the output; the peer closes in turn."""
        with self._lock:
            if self._finishing or self._lost is not None:
                return
            self._finishing = True
        if self.flush():
            self._shutdown(both=False)

    def on_writable(self) -> bool:
        """Progress the send side; True when nothing is left to send."""
        return self._progress_sends(blocked_only=False)

    def resume_blocked_sends(self) -> None:
        """Progress the send side if a send is waiting for the fabric; for
        providers whose ``fileno`` never becomes writable. The check is made
        under the lock, so a flush that is just blocking is not missed."""
        self._progress_sends(blocked_only=True)

    def _progress_sends(self, blocked_only: bool) -> bool:
        with self._lock:
            if blocked_only and not self._writing:
                return True
            done = self._send()
            self._writing = not done
            if done and self._finishing:
                self._shutdown(both=False)
        return done

    def on_readable(self) -> bool:
        """Progress the receive side; False once the device is gone."""
        decoder = self._decoder
        push = self.completion.push
        try:
            for _ in range(64):
                buffer = decoder.get_buffer()
                n = self._receive_into(buffer)
                if not n:
                    decoder.check_eof()
                    return self._fail("closed by peer", logging.DEBUG)
                for event in decoder.buffer_updated(n):
                    push((self, event))
                if n < buffer.nbytes:
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except ProtocolError as e:
            return self._fail(f"protocol error: {e}", logging.WARNING)
        except OSError as e:
            return self._fail(f"{type(e).__name__}: {e}", logging.INFO)
        return True

    def release(self) -> None:
        """Called by the progress engine once the device is unregistered."""
        if self._lost is None:
            self._fail("closed", logging.DEBUG)
        self.released = True
        self._close_transport()

    def _fail(self, reason: str, level: int) -> bool:
        with self._lock:
            if self._lost is not None:
                return False
            self._lost = reason
            tokens = [token for _, _, token in self._marks if token is not None]
            for stream in self._streams.values():
                tokens.extend(token for _, token in stream if token is not None)
            self._streams.clear()
            self._ready.clear()
            self._out.clear()
            self._marks.clear()
        logger.log(level, "%s device %s <-> %s lost: %s", self.provider,
                   self.local_address, self.peer_address, reason)
        self.completion.push((self, DeviceLost(reason, tokens)))
        return False

    def _send(self) -> bool:
        out = self._out
        while True:
            if not out and not self._fill():
                return True
            try:
                n = self._transmit(out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                self._lost_on_send(e)
                return True
            self._consume(n)
            if out:
                return False

    def _lost_on_send(self, error: OSError) -> None:
        logger.debug("send on %s failed: %s", self.peer_address, error)
        self._streams.clear()
        self._ready.clear()
        self._out.clear()
        self._shutdown(both=True)

    def _fill(self) -> bool:
        streams, ready, out = self._streams, self._ready, self._out
        budget = self._batch_bytes
        taken = self._taken
        while ready:
            vc = ready[0]
            stream = streams[vc]
            unit, token = stream[0]
            for buffer in unit.next_unit():
                out.append(buffer)
                taken += len(buffer)
            if unit.done:
                stream.popleft()
                self._marks.append((taken, unit.nbytes, token))
                if not stream:
                    del streams[vc]
                    ready.popleft()
                else:
                    ready.rotate(-1)
            else:
                ready.rotate(-1)
            if taken - self._taken >= budget or len(out) >= IOV_MAX:
                break
        self._taken = taken
        return bool(out)

    def _consume(self, n: int) -> None:
        self._sent += n
        out = self._out
        while n:
            head = out[0]
            size = len(head)
            if n >= size:
                out.popleft()
                n -= size
            else:
                out[0] = memoryview(head)[n:]
                n = 0
        marks = self._marks
        sent = self._sent
        while marks and marks[0][0] <= sent:
            _, nbytes, token = marks.popleft()
            self.queued_bytes -= nbytes
            if token is not None:
                self.completion.push((self, SendDone(token)))
