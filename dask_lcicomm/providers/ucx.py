"""The UCX provider: one-sided puts over the fabric UCX drives (InfiniBand,
RoCE; TCP and shared memory where that is all there is; not Slingshot 11,
EFA or Omni-Path, which only libfabric drives).

Each device owns a UCX worker with one endpoint to its peer's device, so
that the worker's event descriptor is the device's own and progress never
has to guess whose traffic woke it. Messages are UCX tagged sends that no
receive awaits: they land in UCX's queue of unexpected messages, as in LCI's
one-sided puts, and progress finds them by probing, reads their length,
checks it against the limits and only then allocates the buffer they are
received into. The tag says what a message is:

* a *stream* message carries bytes of the parcel stream (heads, eager
  frames, the other control units), in order;
* a *bulk* message carries one bulk group of a parcel, written nowhere
  first: UCX sends a large one by its rendezvous protocol (an RDMA read by
  the receiver on a real fabric), and the buffer it lands in becomes the
  frames handed to Dask. The tag numbers it; the parcel names that number
  (a PLACED record, see :mod:`dask_lcicomm.parcel`).

A parcel whose bulk groups are larger than a send batch joins the stream
only once they have reached the peer: a writer's send completes when its
frames are there, and the small parcels of other virtual connections flow
past a large one meanwhile. A parcel with smaller groups is sent at once,
behind them: the receiver reads the stream on only once they have arrived,
which costs later parcels little and spares this one a round trip.

The endpoint is set up over a TCP side socket that the listener offers in
its greeting: the accepting side opens a UCX listener for exactly one
endpoint and says where. The side socket then stays open: its end tells
each side that the other is gone at once, and an orderly end of output
sends over it how many messages were sent, so that none is lost to the
race between the two paths.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import dask.config
import numpy as np
from distributed.comm.addressing import parse_host_port

from dask_lcicomm.config import Settings
from dask_lcicomm.parcel import OutgoingParcel, ProtocolError
from dask_lcicomm.providers.base import (
    Device,
    DeviceClosed,
    DeviceOptions,
    accept_handshakes,
    connect_timeout,
    shut_socket,
)
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable
from dask_lcicomm.providers.send_queue import Unit
from dask_lcicomm.providers.tcp import bind, open_connection

logger = logging.getLogger(__name__)

#: Tags: bulk message number ``n`` is ``_BULK | n`` (``| _PROMPT`` if its
#: parcel was sent at once); a stream message's tag is the number of prompt
#: bulk messages sent before it, which must have arrived before it is read.
_BULK = 1 << 63
_PROMPT = 1 << 62
_NUMBER = _PROMPT - 1
#: An orderly end of output, on the side socket: how many messages were sent.
_END = struct.Struct("<Q")
_SETUP = struct.Struct("<I")
_MAX_SETUP_BYTES = 4096
#: Stream bytes in flight, in send batches, before sends wait for UCX.
_INFLIGHT_BATCHES = 8
#: Most messages taken from UCX's queue in one pass.
_PROBES = 64
#: Progress calls in one pass before the worker is armed (or left for later).
_PROGRESS_ROUNDS = 16


@functools.cache
def _ucx() -> Any:
    """The ucxx bindings, imported on first use (``ImportError`` without them)."""
    import ucxx._lib.libucxx as ucx

    return ucx


@functools.cache
def _array_type() -> Any:
    from ucxx._lib.arr import Array

    return Array


def context_options(settings: Settings) -> dict[str, str]:
    """The UCX options ``distributed.comm.lci.ucx-options`` sets, but for
    those a ``UCX_<NAME>`` environment variable sets: given to the context,
    they would override it."""
    return {name: value for name, value in settings.ucx_options if f"UCX_{name}" not in os.environ}


class _Context:
    """The process's UCX context, created on first use and kept: UCX reads
    its configuration (``UCX_TLS``, ``UCX_NET_DEVICES``, ``ucx-options``)
    once, when it opens."""

    _lock = threading.Lock()
    _context: Any = None
    _error: str | None = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._context is None and cls._error is None:
                options: dict[str, str] = {}
                try:
                    ucx = _ucx()
                    options = context_options(Settings.from_config())
                    cls._context = ucx.UCXContext(
                        options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
                    )
                except ImportError as e:
                    cls._error = f"ucxx is not installed (pip install 'dask-lcicomm[ucx]'): {e}"
                except Exception as e:
                    given = f" with options {options}" if options else ""
                    cls._error = f"UCX cannot open the fabric{given}: {type(e).__name__}: {e}"
            if cls._error is not None:
                raise ProviderUnavailable(cls._error)
            return cls._context


@functools.cache
def _setup_errors() -> tuple[type[BaseException], ...]:
    """What setting a device up may raise when the peer or UCX cannot do
    it: each means "not over UCX with this peer", never a crash."""
    return (OSError, ValueError, asyncio.TimeoutError, _ucx().UCXError)


def unavailable() -> str | None:
    """Why this process cannot use UCX at all, or None."""
    try:
        _Context.get()
    except ProviderUnavailable as e:
        return str(e)
    return None


def _worker() -> Any:
    worker = _ucx().UCXWorker(_Context.get())
    worker.init_blocking_progress_mode()
    return worker


def _array(buffer: Any) -> Any:
    return _array_type()(buffer)


def _tag(value: int) -> Any:
    return _ucx().UCXXTag(value)


@functools.cache
def _any_tag() -> tuple[Any, Any]:
    """The tag and mask that match every message."""
    return _ucx().UCXXTag(0), _ucx().UCXXTagMask(0)


class _Waiting:
    """A parcel held back until its bulk messages have reached the peer."""

    __slots__ = ("unit", "token", "bulk_out")

    def __init__(self, unit: Unit, token: Any) -> None:
        self.unit = unit
        self.token = token
        #: Bulk messages of this parcel UCX has not finished sending.
        self.bulk_out = 0


class UcxDevice(Device):
    """A device over a UCX worker and endpoint of its own, and a side socket."""

    provider = "ucx"
    watch_writable = False

    def __init__(
        self,
        worker: Any,
        endpoint: Any,
        sock: socket.socket,
        options: DeviceOptions,
        local_address: str,
        peer_address: str,
    ) -> None:
        super().__init__(options, local_address, peer_address, placement=self._take_bulk)
        self._max_bulk_bytes = options.limits.max_message_bytes
        self._max_bulk_count = options.limits.max_frames
        self._batch_bytes = options.batch_bytes
        # Stream bytes UCX may hold before writers wait: back-pressure when
        # the peer takes them more slowly than they are written.
        self._max_inflight = _INFLIGHT_BATCHES * options.batch_bytes
        self._worker = worker
        self._endpoint = endpoint
        self._sock = sock
        # The worker's descriptor and the side socket behind one descriptor.
        self._epoll = select.epoll()
        self._epoll.register(worker.epoll_file_descriptor, select.EPOLLIN)
        self._side_fd = sock.fileno()
        self._epoll.register(self._side_fd, select.EPOLLIN)
        self._fd = self._epoll.fileno()
        # Lock order: waiting, then the device lock, then UCX (called from
        # the event loop for sends and from progress).
        self._waiting_lock = threading.Lock()
        self._ucx_lock = threading.Lock()
        self._failed: str | None = None
        endpoint.set_close_callback(self._endpoint_closed)
        # Send side: parcels waiting for their bulk messages, per virtual
        # connection (in order); requests UCX has not finished.
        self._waiting: dict[int, deque[_Waiting]] = {}
        self._waiting_bytes = 0
        self._finish_when_sent = False
        # The output ends once UCX has finished the sends in flight.
        self._end_after_sends = False
        self._inflight: deque[tuple[Any, int, Any, _Waiting | None]] = deque()
        self._inflight_bytes = 0
        self._sent = 0
        self._bulk_sent = 0
        self._prompt_sent = 0
        self._prompt_bytes = options.batch_bytes
        # Receive side: stream messages being received, in order; bulk
        # messages by number until their parcel takes them.
        self._receiving: deque[tuple[Any, np.ndarray, int]] = deque()
        # Prompt bulk messages in arrival order, until they are complete.
        self._prompt: deque[Any] = deque()
        self._prompt_seen = 0
        self._prompt_done = 0
        self._received = 0
        self._stream: deque[memoryview] = deque()
        self._bulk: dict[int, tuple[Any, np.ndarray]] = {}
        self._bulk_bytes = 0
        self._end: int | None = None
        self._peer_gone = False
        self._armed = False

    def fileno(self) -> int:
        return self._fd

    @property
    def input_pending(self) -> bool:
        return not self.lost and (bool(self._stream) or not self._armed)

    # -- sending ---------------------------------------------------------

    def put(self, vc: int, unit: Unit, token: Any = None) -> bool:
        """Bulk groups leave at once, out of band. A parcel with large ones
        joins the stream once they have arrived, so that it never holds up
        the small parcels of other virtual connections; one with small ones
        follows them at once, as prompt bulk messages."""
        parcel = unit if type(unit) is OutgoingParcel and unit.bulk_groups else None
        with self._waiting_lock:
            if self._lost is not None or self._finishing:
                raise DeviceClosed(self._lost or "device is closing")
            waiting = self._waiting.get(vc)
            if waiting is None and (parcel is None or self._fits_prompt(parcel)):
                if parcel is not None:
                    self._send_bulk(parcel, None)
                return super().put(vc, unit, token)
            held = _Waiting(unit, token)
            if parcel is not None:
                self._send_bulk(parcel, held)
            self._waiting.setdefault(vc, deque()).append(held)
            self._waiting_bytes += unit.nbytes
            # Small bulk messages may have gone at once.
            return self._release_ready()

    def _fits_prompt(self, parcel: OutgoingParcel) -> bool:
        return all(sum(v.nbytes for v in views) <= self._prompt_bytes for views in parcel.bulk_groups)

    def _send_bulk(self, parcel: OutgoingParcel, held: _Waiting | None) -> None:
        """Send each bulk group of ``parcel`` as a message of its own; the
        parcel then carries only their numbers. Without ``held`` they are
        prompt: the parcel follows at once."""
        with self._ucx_lock:
            for group, views in enumerate(parcel.bulk_groups):
                message = views[0] if len(views) == 1 else b"".join(views)
                parcel.place(group, self._bulk_sent, 0)
                tag = _BULK | self._bulk_sent
                if held is None:
                    tag |= _PROMPT
                    self._prompt_sent += 1
                else:
                    held.bulk_out += 1
                self._post(message, _tag(tag), 0, held)
                self._bulk_sent += 1

    def _post(self, message: Any, tag: Any, nbytes: int, held: _Waiting | None) -> None:
        """Hand ``message`` to UCX with ``tag`` (under the UCX lock);
        ``nbytes`` of it count against the stream's bytes in flight."""
        request = self._endpoint.tag_send(_array(message), tag)
        self._sent += 1
        if request.completed:
            self._completed(request, held)
        else:
            self._inflight.append((request, nbytes, message, held))
            self._inflight_bytes += nbytes

    def _completed(self, request: Any, held: _Waiting | None) -> None:
        try:
            request.check_error()
        except Exception as e:
            self._failed = self._failed or f"send failed: {type(e).__name__}: {e}"
            return
        if held is not None:
            held.bulk_out -= 1

    def _reap(self) -> None:
        """Finish the sends UCX has completed (under the UCX lock)."""
        inflight = self._inflight
        for _ in range(len(inflight)):
            entry = inflight.popleft()
            request, nbytes, _, held = entry
            if request.completed:
                self._inflight_bytes -= nbytes
                self._completed(request, held)
            else:
                inflight.append(entry)
        if self._end_after_sends and not inflight:
            self._end_after_sends = False
            self._send_end()

    def _release_waiting(self) -> None:
        """Send the parcels whose bulk messages have all arrived; end the
        output if that was all it waited for."""
        if not self._waiting:
            return
        with self._waiting_lock:
            self._release_ready()
            finish = not self._waiting and self._finish_when_sent
        if finish:
            super().finish()
        else:
            self.flush()

    def _release_ready(self) -> bool:
        """Queue the parcels at the head of each virtual connection's line
        whose bulk messages have all arrived (under the waiting lock); True
        when the caller should flush."""
        flush = False
        for vc, waiting in list(self._waiting.items()):
            while waiting and waiting[0].bulk_out == 0:
                held = waiting.popleft()
                self._waiting_bytes -= held.unit.nbytes
                flush = super().put(vc, held.unit, held.token) or flush
            if not waiting:
                del self._waiting[vc]
        return flush

    @property
    def queued_bytes(self) -> int:
        return super().queued_bytes + self._waiting_bytes

    def flush(self) -> bool:
        return super().flush() and not self._waiting

    def finish(self) -> bool:
        """As for any device, but done only once UCX has finished every send:
        closing the worker earlier would abort the transfers under way."""
        with self._waiting_lock:
            if self._waiting:
                self._finish_when_sent = True
                return False
        return super().finish() and not self._end_after_sends

    def _lose(self, reason: str) -> list[Any] | None:
        tokens = super()._lose(reason)
        if tokens is not None:
            for waiting in self._waiting.values():
                tokens.extend(held.token for held in waiting if held.token is not None)
            self._waiting.clear()
            self._waiting_bytes = 0
        return tokens

    def _transmit(self, buffers: deque[Any]) -> int:
        if self._failed is not None:
            raise ConnectionResetError(self._failed)
        if self._peer_gone:
            raise BrokenPipeError("the peer is gone")
        taken = []
        n = 0
        for buffer in buffers:
            taken.append(buffer)
            n += memoryview(buffer).nbytes
            if n >= self._batch_bytes:
                break
        with self._ucx_lock:
            self._reap()
            if self._inflight_bytes >= self._max_inflight:
                raise BlockingIOError
            self._post(b"".join(taken), _tag(self._prompt_sent), n, None)
        return n

    # -- receiving -------------------------------------------------------

    def on_readable(self) -> bool:
        if self.released:
            return False
        if self._side_fd in dict(self._epoll.poll(0)):
            self._take_side_socket()
        with self._ucx_lock:
            try:
                self._progress()
            except ProtocolError as e:
                return self._fail(f"protocol error: {e}", logging.WARNING, violation=True)
        self._release_waiting()
        self.resume_blocked_sends()
        alive = super().on_readable()
        if alive and self._failed is not None and not self._stream:
            return self._fail(self._failed, logging.INFO)
        return alive

    def _progress(self) -> None:
        """Progress the worker, take what arrived, and arm the worker before
        the engine sleeps on it (left unarmed, input_pending brings the
        engine back)."""
        for _ in range(_PROGRESS_ROUNDS):
            self._worker.progress()
            self._reap()
            if self._take_arrivals() and self._worker.arm():
                self._armed = True
                return
        self._armed = False

    def _take_arrivals(self) -> bool:
        """Receive what arrived, in order: each message into a buffer of its
        length, allocated once that length passed the limits. Stream messages
        are taken in order once complete; bulk messages are set aside by
        number, so later stream messages are taken while one is in flight.
        False when messages may be left in UCX's queue (no event will say
        so: the worker must not be armed)."""
        worker = self._worker
        any_tag = _any_tag()
        drained = False
        for _ in range(_PROBES):
            probe = worker.tag_probe(*any_tag, remove=True)
            if not probe.matched:
                drained = True
                break
            self._received += 1
            tag, nbytes = probe.sender_tag.value, probe.length
            if tag & _BULK:
                handle = tag & _NUMBER
                self._bulk_bytes += nbytes
                if self._bulk_bytes > self._max_bulk_bytes or len(self._bulk) >= self._max_bulk_count:
                    raise ProtocolError(f"bulk messages waiting exceed {self._max_bulk_bytes} bytes")
                if handle in self._bulk:
                    raise ProtocolError(f"bulk message {handle} arrived twice")
                buffer = np.empty(nbytes, np.uint8)
                request = worker.tag_recv_with_handle(_array(buffer), probe)
                self._bulk[handle] = (request, buffer)
                if tag & _PROMPT:
                    self._prompt.append(request)
                    self._prompt_seen += 1
            else:
                if tag > self._prompt_seen:
                    raise ProtocolError(f"a stream message waits for {tag} prompt bulk messages, "
                                        f"{self._prompt_seen} came")
                if nbytes > self._max_bulk_bytes:
                    raise ProtocolError(f"a {nbytes}-byte stream message exceeds the limit")
                buffer = np.empty(nbytes, np.uint8)
                self._receiving.append((worker.tag_recv_with_handle(_array(buffer), probe), buffer, tag))
        prompt = self._prompt
        while prompt and prompt[0].completed:
            prompt.popleft()
            self._prompt_done += 1
        receiving = self._receiving
        while receiving and receiving[0][0].completed and receiving[0][2] <= self._prompt_done:
            request, buffer, _ = receiving.popleft()
            request.check_error()
            if buffer.nbytes:
                self._stream.append(buffer.data)
        return drained

    def _take_bulk(self, handle: int, offset: int, nbytes: int) -> memoryview:
        """The bulk group the peer sent as message ``handle``: the frames.
        The peer names it only once it has arrived whole."""
        entry = self._bulk.pop(handle, None)
        if entry is None or offset or not entry[0].completed:
            raise ProtocolError(f"bulk message {handle} (offset {offset}) has not arrived")
        request, buffer = entry
        request.check_error()
        self._bulk_bytes -= buffer.nbytes
        if buffer.nbytes != nbytes:
            raise ProtocolError(f"bulk message {handle} has {buffer.nbytes} bytes, not {nbytes}")
        return buffer.data

    def _receive_into(self, buffer: memoryview) -> int:
        stream = self._stream
        n = 0
        while stream and n < buffer.nbytes:
            chunk = stream[0]
            take = min(chunk.nbytes, buffer.nbytes - n)
            buffer[n : n + take] = chunk[:take]
            n += take
            if take == chunk.nbytes:
                stream.popleft()
            else:
                stream[0] = chunk[take:]
        if n:
            return n
        if self._ended():
            return 0
        raise BlockingIOError

    def _ended(self) -> bool:
        """Whether the peer's output is over: all it said it sent arrived,
        or it is gone (its last words lost with it)."""
        if self._end is not None:
            return self._received >= self._end and not self._receiving
        return self._peer_gone or self._failed is not None

    def _take_side_socket(self) -> None:
        """Read the peer's count of messages sent, or the end of the socket."""
        try:
            data = self._sock.recv(_END.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if len(data) == _END.size and self._end is None:
            (self._end,) = _END.unpack(data)
        elif not data:
            self._peer_gone = True
            self._epoll.unregister(self._side_fd)

    def _endpoint_closed(self, *args: Any) -> None:
        self._failed = self._failed or "the UCX endpoint failed"

    # -- ending ----------------------------------------------------------

    def _shutdown(self, both: bool) -> None:
        if both:
            shut_socket(self._sock, both=True)
            return
        with self._ucx_lock:
            if self._inflight:
                self._end_after_sends = True
            else:
                self._send_end()

    def _send_end(self) -> None:
        """End the output: say how many messages were sent (under the UCX lock)."""
        try:
            self._sock.send(_END.pack(self._sent))
        except OSError:
            pass
        shut_socket(self._sock, both=False)

    def _close_transport(self) -> None:
        self._decoder.placement = None
        with self._ucx_lock:
            self._endpoint.remove_close_callback()
            # Pending requests hold the worker: cancel them, then close.
            self._worker.cancel_inflight_requests()
            self._endpoint.close_blocking()
            self._inflight.clear()
            self._receiving.clear()
            self._prompt.clear()
            self._bulk.clear()
            self._stream.clear()
            self._endpoint = None
            self._worker = None
        self._epoll.close()
        self._sock.close()


# -- setting a device up over the side socket ---------------------------


async def _send_setup(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    await asyncio.get_running_loop().sock_sendall(sock, _SETUP.pack(len(data)) + data)


async def _receive_setup(sock: socket.socket) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    head = await _receive_exactly(loop, sock, _SETUP.size)
    (n,) = _SETUP.unpack(head)
    if n > _MAX_SETUP_BYTES:
        raise ProviderUnavailable(f"a {n}-byte UCX setup message is too long")
    try:
        message = json.loads(await _receive_exactly(loop, sock, n))
    except ValueError as e:
        raise ProviderUnavailable(f"malformed UCX setup message: {e}") from e
    if not isinstance(message, dict):
        raise ProviderUnavailable("malformed UCX setup message")
    return message


async def _receive_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(sock, n - len(data))
        if not chunk:
            raise ProviderUnavailable("the peer closed the UCX setup socket")
        data += chunk
    return data


async def _accept_endpoint(worker: Any, sock: socket.socket, timeout: float) -> Any:
    """Open a UCX listener for one endpoint, say where, and wait for it."""
    endpoints: list[Any] = []

    def connected(endpoint: Any, *args: Any) -> None:
        endpoints.append(endpoint)

    listener = _ucx().UCXListener.create(worker, 0, connected, deliver_endpoint=True)
    try:
        await _send_setup(sock, {"port": listener.port})
        deadline = time.monotonic() + timeout
        while not endpoints:
            worker.progress()
            if time.monotonic() > deadline:
                raise ProviderUnavailable(f"no UCX endpoint connected within {timeout} s")
            await asyncio.sleep(0.001)
    finally:
        del listener
    # The listener's callback keeps ``endpoints``: empty it, or the endpoints
    # and the worker live on in a cycle through UCX that no collector sees.
    endpoint, *extra = endpoints
    endpoints.clear()
    for other in extra:
        other.close()
    return endpoint


async def accept(sock: socket.socket, options: DeviceOptions, timeout: float) -> UcxDevice:
    """The accepting side of the setup, on a connection to the side socket."""
    try:
        request = await asyncio.wait_for(_receive_setup(sock), timeout)
        worker = _worker()
        endpoint = await _accept_endpoint(worker, sock, timeout)
    except _setup_errors() as e:
        raise ProviderUnavailable(f"UCX setup failed: {type(e).__name__}: {e}") from e
    return UcxDevice(
        worker, endpoint, sock, options, str(request.get("peer", "")), str(request.get("local", ""))
    )


async def connect(peer: PeerOffer, options: DeviceOptions, timeout: float) -> UcxDevice:
    """The connecting side: reach the peer's side socket, then its endpoint."""
    if not (isinstance(peer.offer, int) and 0 < peer.offer < 65536):
        raise ProviderUnavailable(f"malformed UCX offer {peer.offer!r}")
    host, _ = parse_host_port(peer.peer_address.split("://", 1)[-1])
    if ":" in host:
        raise ProviderUnavailable("ucxx's UCX listeners accept IPv4 only")
    try:
        sock = await open_connection(host, peer.offer, timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise ProviderUnavailable(f"cannot reach the UCX setup socket: {e!r}") from e
    try:
        await _send_setup(sock, {"local": peer.local_address, "peer": peer.peer_address})
        reply = await asyncio.wait_for(_receive_setup(sock), timeout)
        port = reply.get("port")
        if not isinstance(port, int):
            raise ProviderUnavailable(f"malformed UCX setup reply {reply!r}")
        worker = _worker()
        endpoint = worker.create_endpoint_from_hostname(host, port, True)
        return UcxDevice(worker, endpoint, sock, options, peer.local_address, peer.peer_address)
    except _setup_errors() as e:
        sock.close()
        raise ProviderUnavailable(f"UCX setup failed: {type(e).__name__}: {e}") from e
    except BaseException:
        sock.close()
        raise


class UcxProvider(Provider):
    """UCX with a peer whose listener offers it and that UCX can reach."""

    name = "ucx"

    def unavailable(self) -> str | None:
        return unavailable()

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        sock = bind(host, 0, int(dask.config.get("distributed.comm.socket-backlog")))
        setup_port = sock.getsockname()[1]
        timeout = connect_timeout()

        async def handshake(conn: socket.socket) -> Device:
            return await accept(conn, options, timeout)

        close = accept_handshakes(sock, handshake, accepted, f"UCX setup port {setup_port}")
        return Offering(close=close, offer=setup_port)

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        return await connect(peer, options, connect_timeout())


PROVIDER = UcxProvider()
