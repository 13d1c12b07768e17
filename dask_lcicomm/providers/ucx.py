"""The UCX provider: one-sided puts over the fabric UCX drives (InfiniBand,
RoCE, Slingshot; TCP and shared memory where that is all there is).

Each device owns a UCX worker with one endpoint to its peer's device, so
that the worker's event descriptor is the device's own and progress never
has to guess whose traffic woke it. Everything travels as UCX *active
messages*: the data lands at the peer with no receive posted, as in LCI.
Two kinds share one endpoint, in order:

* a *stream* message carries bytes of the parcel stream (heads, eager
  frames, the other control units), behind a u32 count of the bulk
  messages that follow it;
* a *bulk* message carries one bulk group of a parcel, written nowhere
  first: UCX sends a large one by its rendezvous protocol (an RDMA read by
  the receiver on a real fabric), and the receiver hands the buffer UCX
  received it into to Dask as the frames themselves. The parcel names the
  group by the bulk message's number (a PLACED record, see
  :mod:`dask_lcicomm.parcel`), and the group is sent before the parcel's
  head, so it has arrived when the head is decoded.

A writer's send completes once its stream bytes are handed to UCX (they
are copied into one message) and its bulk groups have reached the peer.

The endpoint is set up over a TCP side socket that the listener offers in
its greeting: the accepting side opens a UCX listener for exactly one
endpoint and says where. The side socket then stays open: its end tells
each side that the other is gone at once, and an orderly end of output
sends over it how many messages were sent, so that none is lost to the
race between the two paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import dask.config
from distributed.comm.addressing import parse_host_port

from dask_lcicomm.config import Settings
from dask_lcicomm.parcel import OutgoingParcel, ProtocolError
from dask_lcicomm.providers.base import (
    Device,
    DeviceLost,
    DeviceOptions,
    SendDone,
    accept_handshakes,
    connect_timeout,
    shut_socket,
)
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable
from dask_lcicomm.providers.send_queue import Unit
from dask_lcicomm.providers.tcp import bind, open_connection

logger = logging.getLogger(__name__)

#: A stream message: how many bulk messages follow it, then stream bytes.
_STREAM = struct.Struct("<I")
#: An orderly end of output, on the side socket: how many messages were sent.
_END = struct.Struct("<Q")
_SETUP = struct.Struct("<I")
_MAX_SETUP_BYTES = 4096
#: Progress calls in one pass before the worker is armed (or left for later).
_PROGRESS_ROUNDS = 16


def _ucx() -> Any:
    """The ucxx bindings, imported on first use (``ImportError`` without them)."""
    import ucxx._lib.libucxx as ucx

    return ucx


class _Context:
    """The process's UCX context, created on first use and kept: UCX reads
    its configuration (``UCX_TLS``, ``UCX_NET_DEVICES``) once, when it opens."""

    _lock = threading.Lock()
    _context: Any = None
    _error: str | None = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._context is None and cls._error is None:
                try:
                    ucx = _ucx()
                    cls._context = ucx.UCXContext(
                        {}, feature_flags=(ucx.Feature.AM, ucx.Feature.WAKEUP)
                    )
                except ImportError as e:
                    cls._error = f"ucxx is not installed (pip install 'dask-lcicomm[ucx]'): {e}"
                except Exception as e:
                    cls._error = f"UCX cannot open the fabric: {type(e).__name__}: {e}"
            if cls._error is not None:
                raise ProviderUnavailable(cls._error)
            return cls._context


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
    from ucxx._lib.arr import Array

    return Array(buffer)


class _Held:
    """A writer's token held until its parcel's stream bytes and bulk
    messages have all gone: ``parts`` of them are still out."""

    __slots__ = ("token", "parts")

    def __init__(self, token: Any, parts: int) -> None:
        self.token = token
        self.parts = parts


class _TokenGate:
    """The completion sink seen by the device's send queue: passes a held
    token on when its last part completes, and every other event as is."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def push(self, item: tuple[Device, Any]) -> None:
        device, event = item
        if type(event) is SendDone and type(event.token) is _Held:
            self.part_done(device, event.token)
        elif type(event) is DeviceLost:
            tokens = [t.token if type(t) is _Held else t for t in event.tokens]
            self._sink.push((device, DeviceLost(event.reason, tokens, event.violation)))
        else:
            self._sink.push(item)

    def part_done(self, device: Device, held: _Held) -> None:
        held.parts -= 1
        if held.parts == 0 and held.token is not None:
            self._sink.push((device, SendDone(held.token)))


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
        self._gate = _TokenGate(self.completion)
        self.completion = self._gate
        self._max_bulk_bytes = options.limits.max_message_bytes
        self._max_bulk_count = options.limits.max_frames
        self._batch_bytes = options.batch_bytes
        self._worker = worker
        self._endpoint = endpoint
        self._sock = sock
        # The worker's descriptor and the side socket behind one descriptor.
        self._epoll = select.epoll()
        self._epoll.register(worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        # UCX is called from the event loop (sends) and from progress.
        self._ucx_lock = threading.Lock()
        self._failed: str | None = None
        endpoint.set_close_callback(self._endpoint_closed)
        # Send side: requests UCX has not finished, and what they hold.
        self._inflight: deque[tuple[Any, Any, _Held | None]] = deque()
        self._sent = 0
        self._bulk_sent = 0
        # Receive side.
        self._receiving: Any = None
        self._received = 0
        self._stream: deque[memoryview] = deque()
        self._bulk_due = 0
        self._bulk: dict[int, Any] = {}
        self._bulk_received = 0
        self._bulk_bytes = 0
        self._end: int | None = None
        self._peer_gone = False
        self._armed = False

    def fileno(self) -> int:
        return self._epoll.fileno()

    @property
    def input_pending(self) -> bool:
        return not self.lost and (bool(self._stream) or not self._armed)

    # -- sending ---------------------------------------------------------

    def put(self, vc: int, unit: Unit, token: Any = None) -> bool:
        if type(unit) is OutgoingParcel and unit.bulk_groups and not self.lost:
            held = _Held(token, 1)
            with self._lock:
                self._send_bulk(unit, held)
            token = held
        return super().put(vc, unit, token)

    def _send_bulk(self, parcel: OutgoingParcel, held: _Held) -> None:
        """Send each bulk group of ``parcel`` as a message of its own, behind
        a stream message announcing them; the parcel then carries only their
        numbers. Under the device lock, so nothing of this parcel's stream
        can overtake them."""
        groups = parcel.bulk_groups
        messages = []
        for views in groups:
            messages.append(views[0] if len(views) == 1 else b"".join(views))
        with self._ucx_lock:
            if self._failed is not None:
                return
            self._post(_STREAM.pack(len(messages)), None)
            for group, message in enumerate(messages):
                parcel.place(group, self._bulk_sent, 0)
                self._bulk_sent += 1
                held.parts += 1
                self._post(message, held)

    def _post(self, message: Any, held: _Held | None) -> None:
        """Hand ``message`` to UCX (under the UCX lock)."""
        request = self._endpoint.am_send(_array(message))
        self._sent += 1
        if request.completed:
            self._completed(request, held)
        else:
            self._inflight.append((request, message, held))

    def _completed(self, request: Any, held: _Held | None) -> None:
        try:
            request.check_error()
        except Exception as e:
            self._failed = self._failed or f"send failed: {type(e).__name__}: {e}"
            return
        if held is not None:
            self._gate.part_done(self, held)

    def _reap(self) -> None:
        """Finish the sends UCX has completed, in order (under the UCX lock)."""
        inflight = self._inflight
        while inflight and inflight[0][0].completed:
            request, _, held = inflight.popleft()
            self._completed(request, held)

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
            self._post(b"".join([_STREAM.pack(0), *taken]), None)
            self._armed = False
        return n

    # -- receiving -------------------------------------------------------

    def on_readable(self) -> bool:
        if self.released:
            return False
        self._take_side_socket()
        with self._ucx_lock:
            try:
                self._progress()
            except ProtocolError as e:
                return self._fail(f"protocol error: {e}", logging.WARNING, violation=True)
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
            self._take_arrivals()
            if self._stream:
                self._armed = False
                return
            if self._worker.arm():
                self._armed = True
                return
        self._armed = False

    def _take_arrivals(self) -> None:
        endpoint = self._endpoint
        while True:
            request = self._receiving
            if request is None:
                request = self._receiving = endpoint.am_recv()
            if not request.completed:
                return
            self._receiving = None
            request.check_error()
            self._arrived(request.recv_buffer)

    def _arrived(self, buffer: Any) -> None:
        self._received += 1
        data = memoryview(buffer).cast("B")
        if self._bulk_due:
            self._bulk_due -= 1
            self._bulk_bytes += data.nbytes
            if self._bulk_bytes > self._max_bulk_bytes:
                raise ProtocolError(f"bulk messages waiting exceed {self._max_bulk_bytes} bytes")
            self._bulk[self._bulk_received] = buffer
            self._bulk_received += 1
            return
        if data.nbytes < _STREAM.size:
            raise ProtocolError(f"a {data.nbytes}-byte message is no stream message")
        (bulk,) = _STREAM.unpack_from(data)
        if bulk > self._max_bulk_count:
            raise ProtocolError(f"{bulk} bulk messages announced, more than {self._max_bulk_count}")
        self._bulk_due = bulk
        if data.nbytes > _STREAM.size:
            self._stream.append(data[_STREAM.size :])

    def _take_bulk(self, handle: int, offset: int, nbytes: int) -> memoryview:
        """The bulk group the peer sent as message ``handle``: the frames."""
        buffer = self._bulk.pop(handle, None)
        if buffer is None or offset:
            raise ProtocolError(f"no bulk message {handle} (offset {offset}) has arrived")
        view = memoryview(buffer).cast("B")
        self._bulk_bytes -= view.nbytes
        if view.nbytes != nbytes:
            raise ProtocolError(f"bulk message {handle} has {view.nbytes} bytes, not {nbytes}")
        return view

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
            return self._received >= self._end
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
            self._epoll.unregister(self._sock.fileno())

    def _endpoint_closed(self, *args: Any) -> None:
        self._failed = self._failed or "the UCX endpoint failed"

    # -- ending ----------------------------------------------------------

    def _shutdown(self, both: bool) -> None:
        if not both:
            try:
                self._sock.send(_END.pack(self._sent))
            except OSError:
                pass
        shut_socket(self._sock, both)

    def _close_transport(self) -> None:
        self._decoder.placement = None
        with self._ucx_lock:
            self._endpoint.remove_close_callback()
            self._endpoint.close()
            self._inflight.clear()
            self._bulk.clear()
            self._stream.clear()
            self._receiving = None
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
    message = json.loads(await _receive_exactly(loop, sock, n))
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
    for extra in endpoints[1:]:
        extra.close()
    return endpoints[0]


async def accept(sock: socket.socket, options: DeviceOptions, timeout: float) -> UcxDevice:
    """The accepting side of the setup, on a connection to the side socket."""
    request = await asyncio.wait_for(_receive_setup(sock), timeout)
    worker = _worker()
    endpoint = await _accept_endpoint(worker, sock, timeout)
    return UcxDevice(
        worker, endpoint, sock, options, str(request.get("peer", "")), str(request.get("local", ""))
    )


async def connect(peer: PeerOffer, options: DeviceOptions, timeout: float) -> UcxDevice:
    """The connecting side: reach the peer's side socket, then its endpoint."""
    if not (isinstance(peer.offer, int) and 0 < peer.offer < 65536):
        raise ProviderUnavailable(f"malformed UCX offer {peer.offer!r}")
    host, _ = parse_host_port(peer.peer_address.split("://", 1)[-1])
    try:
        sock = await asyncio.wait_for(open_connection(host, peer.offer), timeout)
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
    except (OSError, ValueError, asyncio.TimeoutError) as e:
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
