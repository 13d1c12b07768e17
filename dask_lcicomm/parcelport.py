"""The parcelport: this process's lci:// endpoint on one event loop.

It owns the progress engine, the completion object, every device and the
channels to remote listeners, and it routes each completion to its virtual
connection. Dask comms between the same two processes are virtual
connections multiplexed over one channel, so a thousand comms do not cost a
thousand sockets. The parcelport exists while a comm, device or listener
does; when the last one goes, progress stops (and its threads exit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import weakref
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import parse_bytes, parse_timedelta
from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import CommClosedError

from dask_lcicomm.channel import Channel
from dask_lcicomm.config import Settings
from dask_lcicomm.comm.comm import LCIComm
from dask_lcicomm.parcel import (
    Close,
    Connect,
    Hello,
    Limits,
    Message,
    encode_close,
    encode_connect,
    encode_hello,
)
from dask_lcicomm.progress import ProgressEngine, make_completion
from dask_lcicomm.providers import shm
from dask_lcicomm.providers.base import Device, DeviceClosed, DeviceLost, Raw, SendDone, Unit
from dask_lcicomm.providers.shm import ShmDevice, ShmUnavailable
from dask_lcicomm.providers.shm_segment import Layout
from dask_lcicomm.providers.tcp import TcpDevice, configure_socket, open_connection

if TYPE_CHECKING:
    from dask_lcicomm.comm.listener import LCIListener

logger = logging.getLogger("dask_lcicomm.parcelport")

SCHEME = "lci://"
LINGER = 10.0


def _address(sockaddr: tuple[Any, ...]) -> str:
    return SCHEME + unparse_host_port(sockaddr[0], sockaddr[1])


class Parcelport:
    """One per event loop; get it with :meth:`current`."""

    _ports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Parcelport] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def current(cls) -> Parcelport:
        """The parcelport of the running event loop, created on first use."""
        loop = asyncio.get_running_loop()
        port = cls._ports.get(loop)
        if port is None:
            port = cls._ports[loop] = cls(loop, Settings.from_config())
        return port

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
        self.loop = loop
        self.settings = settings
        self.limits = Limits(
            max_message_bytes=settings.max_message_bytes,
            max_frames=settings.max_frames,
            max_eager_bytes=settings.max_eager_bytes,
        )
        self.completion = make_completion(
            settings.completion, loop, self._handle, threadsafe=settings.progress == "thread"
        )
        self.engine = ProgressEngine(
            loop,
            settings.progress,
            self.completion,
            nthreads=settings.progress_threads,
            poll_interval=settings.poll_interval,
        )
        self.identity = {"pid": os.getpid(), "host": socket.gethostname()}
        self._shard_bytes = parse_bytes(dask.config.get("distributed.comm.shard"))
        self._channels: dict[str, Channel] = {}
        self._devices: set[Device] = set()
        self._listeners: set[LCIListener] = set()
        self._hellos: dict[Device, asyncio.Future[None]] = {}
        self._greeted: set[Device] = set()
        self._accepts: dict[tuple[Device, int], asyncio.Future[None]] = {}
        self._unflushed: dict[Device, None] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.shm_layout = Layout(settings.shm_ring_size, settings.shm_pool_size, settings.shm_pool_blocks)
        self.shm_unavailable = None if "shm" in settings.providers else "not in providers"
        if self.shm_unavailable is None:
            self.shm_unavailable = shm.unavailable()
            if self.shm_unavailable is not None:
                logger.warning("shared memory is unavailable, using tcp: %s", self.shm_unavailable)
        self.closed = False

    # -- lifetime -----------------------------------------------------------

    def add_listener(self, listener: LCIListener) -> None:
        self._listeners.add(listener)

    def remove_listener(self, listener: LCIListener) -> None:
        self._listeners.discard(listener)
        self._maybe_shut_down()

    def _maybe_shut_down(self) -> None:
        if self._devices or self._listeners or self._channels or self.closed:
            return
        self.closed = True
        if self._ports.get(self.loop) is self:
            del self._ports[self.loop]
        for task in self._handshakes:
            task.cancel()
        self.engine.close()

    # -- devices ------------------------------------------------------------

    @property
    def prefers_shm(self) -> bool:
        """Whether a channel should try shared memory before tcp."""
        providers = self.settings.providers
        return self.shm_unavailable is None and providers.index("shm") < providers.index("tcp")

    def _device_options(self, listener: LCIListener | None) -> dict[str, Any]:
        return {
            "completion": self.completion,
            "want_write": self.engine.want_write,
            "limits": self.limits,
            "batch_bytes": self.settings.fragment_size,
            "accepting": listener is not None,
            "shard_bytes": self._shard_bytes,
        }

    def _adopt(
        self, device: Device, index: int, listener: LCIListener | None, local: str, peer: str
    ) -> Device:
        device.index = index
        device.listener = listener
        device.local_address = local
        device.peer_address = peer
        self._devices.add(device)
        self.engine.add(device)
        return device

    def _tcp_device(self, sock: socket.socket, index: int, listener: LCIListener | None) -> Device:
        return self._adopt(
            TcpDevice(sock, **self._device_options(listener)),
            index,
            listener,
            _address(sock.getsockname()),
            _address(sock.getpeername()),
        )

    def accept(self, sock: socket.socket, listener: LCIListener) -> None:
        """Adopt a socket accepted by ``listener``; it must greet us first."""
        try:
            configure_socket(sock)
            self._tcp_device(sock, 0, listener)
        except OSError as e:
            logger.info("dropping connection accepted by %s: %s", listener.contact_address, e)
            sock.close()

    def accept_shm(self, sock: socket.socket, listener: LCIListener) -> None:
        """A peer on this host connected to ``listener``'s shared-memory socket."""
        task = self.loop.create_task(self._accept_shm(sock, listener))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _accept_shm(self, sock: socket.socket, listener: LCIListener) -> None:
        try:
            link = await shm.accept(sock, self.shm_layout, self._connect_timeout())
        except ShmUnavailable as e:
            logger.info("refusing shared memory on %s: %s", listener.contact_address, e)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        device = ShmDevice(link, **self._device_options(listener))
        self._adopt(device, 0, listener, link.local_address, link.peer_address)

    async def open_device(self, host: str, port: int, index: int) -> Device:
        """Connect one tcp device of a channel and exchange greetings."""
        sock = await open_connection(host, port)
        return await self._greeted_device(self._tcp_device(sock, index, None))

    async def open_shm_device(self, tcp: Device, index: int) -> Device:
        """Connect one shm device to the peer that greeted us on ``tcp``;
        :class:`ShmUnavailable` if shared memory cannot be used with it."""
        info = tcp.peer_info
        link = await shm.connect(
            info["shm"], info.get("pid"), self.shm_layout,
            tcp.local_address, tcp.peer_address, self._connect_timeout(),
        )
        device = ShmDevice(link, **self._device_options(None))
        self._adopt(device, index, None, link.local_address, link.peer_address)
        try:
            return await self._greeted_device(device)
        except (OSError, asyncio.TimeoutError) as e:
            raise ShmUnavailable(f"no greeting over shared memory: {e!r}") from e

    async def _greeted_device(self, device: Device) -> Device:
        hello = self.loop.create_future()
        self._hellos[device] = hello
        try:
            self.send(device, 0, Raw(self._hello(device)))
            await asyncio.wait_for(asyncio.shield(hello), self._connect_timeout())
        except BaseException:
            self._close_device(device)
            raise
        return device

    def _connect_timeout(self) -> float:
        return parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")

    def send(self, device: Device, vc: int, unit: Unit, token: Any = None) -> None:
        """Queue ``unit`` on ``device``; raises :class:`DeviceClosed`.

        Without aggregation the parcel leaves at once (as far as the device
        is not busy). With it, the first send of an event-loop iteration
        leaves at once and whatever is written after it in the same
        iteration, by any comm, leaves together when the iteration is over;
        a backlog of ``fragment-size`` bytes is flushed at once.
        """
        if device.put(vc, unit, token) or not self.settings.aggregation:
            self._flush_device(device)
        elif self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)
            self._flush_device(device)
        else:
            self._unflushed[device] = None

    def _flush_device(self, device: Device) -> None:
        device.flush()
        self.completion.flush()

    def _flush(self) -> None:
        self._flush_handle = None
        devices, self._unflushed = self._unflushed, {}
        for device in devices:
            device.flush()
        self.completion.flush()

    def _hello(self, device: Device) -> bytes:
        """Who we are; a listener on this host also offers its shared memory."""
        identity = self.identity
        name = getattr(device.listener, "shm_name", None)
        if name is not None:
            identity = {**identity, "shm": name}
        return encode_hello(json.dumps(identity).encode())

    def _close_device(self, device: Device) -> None:
        self.engine.remove(device)

    def finish_device(self, device: Device) -> None:
        """Close ``device`` gracefully: flush, end output, wait for the peer's end."""
        try:
            device.finish()
        except OSError:
            pass
        self.loop.call_later(LINGER, self._close_device, device)

    def connections(self) -> list[dict[str, Any]]:
        """What each device connects to and over which provider (diagnostics)."""
        return [
            {
                "provider": device.provider,
                "local_address": device.local_address,
                "peer_address": device.peer_address,
                "peer_pid": device.peer_info.get("pid"),
                "peer_host": device.peer_info.get("host"),
                "comms": len(device.vcs),
            }
            for device in self._devices
            if not device.lost
        ]

    # -- channels and virtual connections ---------------------------------

    async def connect(self, host: str, port: int, deserialize: bool) -> LCIComm:
        """Open a virtual connection to the listener at ``host:port``."""
        key = unparse_host_port(host, port)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = Channel(self, key)
            channel.start(host, port)
        device, vc = await channel.allocate()
        comm = LCIComm(self, device, vc, device.local_address, device.peer_address, deserialize)
        device.vcs[vc] = comm
        accepted = self._accepts[device, vc] = self.loop.create_future()
        try:
            self.send(device, vc, Raw(encode_connect(vc)))
            await accepted
        except DeviceClosed as e:
            comm.abort()
            raise CommClosedError(f"channel to {SCHEME}{key} closed: {e}") from e
        except BaseException:
            comm.abort()
            raise
        finally:
            self._accepts.pop((device, vc), None)
        return comm

    def forget_channel(self, channel: Channel) -> None:
        if self._channels.get(channel.key) is channel:
            del self._channels[channel.key]
        self._maybe_shut_down()

    def vc_closed(self, device: Device, vc: int) -> None:
        """The local side of ``vc`` closed: free the id, maybe the channel."""
        if device.vcs.pop(vc, None) is not None and device.channel is not None:
            device.channel.maybe_close()

    # -- completions ----------------------------------------------------------

    def _handle(self, batch: list[tuple[Device, Any]]) -> None:
        """Route a batch of completions (runs on the event loop).

        A failure routing one completion is logged and must not lose the rest
        of the batch.
        """
        for device, event in batch:
            try:
                self._dispatch(device, event)
            except Exception:
                logger.exception(
                    "failed to handle %s from %s", type(event).__name__, device.peer_address
                )

    def _dispatch(self, device: Device, event: Any) -> None:
        kind = type(event)
        if kind is Message:
            comm = device.vcs.get(event.vc)
            if comm is not None:
                comm._deliver(event.frames)
        elif kind is SendDone:
            if not event.token.done():
                event.token.set_result(None)
        elif kind is DeviceLost:
            self._lost(device, event)
        elif device not in self._greeted:
            if kind is Hello:
                self._greet(device, event.payload)
            else:
                self._violation(device, f"{kind.__name__} before HELLO")
        elif kind is Connect:
            if device.listener is None:
                self._accepted(device, event.vc)
            else:
                self._open_vc(device, event.vc)
        elif kind is Close:
            comm = device.vcs.get(event.vc)
            if comm is not None:
                self._refused(device, event.vc)
                comm._closed_by_peer("closed by peer")
        else:
            self._violation(device, "second HELLO")

    def _greet(self, device: Device, payload: bytes) -> None:
        try:
            info = json.loads(payload)
            if not isinstance(info, dict):
                raise ValueError("not an object")
        except ValueError as e:
            self._violation(device, f"malformed HELLO: {e}")
            return
        self._greeted.add(device)
        device.peer_info = {key: info.get(key) for key in ("pid", "host")}
        if isinstance(info.get("shm"), str) and len(info["shm"]) <= 100:
            device.peer_info["shm"] = info["shm"]
        hello = self._hellos.pop(device, None)
        if hello is not None:
            if not hello.done():
                hello.set_result(None)
            return
        try:
            self.send(device, 0, Raw(self._hello(device)))
        except DeviceClosed:
            pass

    def _accepted(self, device: Device, vc: int) -> None:
        accepted = self._accepts.get((device, vc))
        if accepted is None:
            self._violation(device, f"unexpected CONNECT for vc {vc}")
        elif not accepted.done():
            accepted.set_result(None)

    def _refused(self, device: Device, vc: int) -> None:
        accepted = self._accepts.get((device, vc))
        if accepted is not None and not accepted.done():
            accepted.set_exception(
                ConnectionRefusedError(f"{device.peer_address} refused a new comm: listener stopped")
            )
            if device.channel is not None:
                device.channel.retire()

    def _open_vc(self, device: Device, vc: int) -> None:
        """The peer opens ``vc``: accept it if our listener still listens."""
        listener = device.listener
        reply = encode_connect(vc) if listener in self._listeners else encode_close(vc)
        try:
            self.send(device, vc, Raw(reply))
        except DeviceClosed:
            return
        if listener not in self._listeners:
            logger.debug("refused vc %d from %s: listener stopped", vc, device.peer_address)
            return
        comm = LCIComm(
            self, device, vc, device.local_address, device.peer_address, listener.deserialize
        )
        comm.allow_offload = listener.allow_offload
        device.vcs[vc] = comm
        listener.handle(comm)

    def _violation(self, device: Device, reason: str) -> None:
        logger.warning(
            "closing lci connection %s <-> %s: %s", device.local_address, device.peer_address, reason
        )
        self._close_device(device)

    def _lost(self, device: Device, event: DeviceLost) -> None:
        self._close_device(device)
        self._devices.discard(device)
        self._greeted.discard(device)
        hello = self._hellos.pop(device, None)
        if hello is not None and not hello.done():
            hello.set_exception(ConnectionResetError(f"connection lost during greeting: {event.reason}"))
        error = CommClosedError(f"lci connection to {device.peer_address} lost: {event.reason}")
        for token in event.tokens:
            if not token.done():
                token.set_exception(error)
        comms = list(device.vcs.items())
        device.vcs.clear()
        for vc, comm in comms:
            accepted = self._accepts.get((device, vc))
            if accepted is not None and not accepted.done():
                accepted.set_exception(ConnectionResetError(str(error)))
            comm._closed_by_peer(str(error))
        if device.channel is not None:
            device.channel.device_lost()
        self._maybe_shut_down()


async def connections() -> list[dict[str, Any]]:
    """The lci:// devices of the calling event loop's process and their
    providers, for diagnostics: ``client.run(connections)`` asks every worker."""
    port = Parcelport._ports.get(asyncio.get_running_loop())
    return port.connections() if port is not None else []
