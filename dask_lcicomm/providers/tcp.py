"""The TCP provider: works between any two hosts.

The one-sided put is emulated: the receiver's progress reads each bulk
fragment straight into the buffer allocated from the parcel's header (see
:class:`~dask_lcicomm.parcel.ParcelDecoder`), and the sender hands the kernel
the caller's own buffers with ``sendmsg`` (scatter-gather), so large frames
are copied by nobody but the kernel.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.comm.addressing import unparse_host_port

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.base import Device, DeviceOptions, connect_timeout
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider
from dask_lcicomm.providers.send_queue import IOV_MAX
from dask_lcicomm.providers.sockets import shut_socket, watch_accepts

logger = logging.getLogger(__name__)


def configure_socket(sock: socket.socket) -> None:
    """No Nagle delay, and keep-alive so that a vanished peer is noticed."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    timeout = int(parse_timedelta(dask.config.get("distributed.comm.timeouts.tcp"), "s"))
    if timeout and hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(2, timeout // 4)
        probes = 10
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, (timeout - idle) // probes))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    if timeout and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout * 1000)


#: Seconds the first attempt to connect waits before a fresh socket tries
#: again; each further attempt waits twice as long.
FIRST_ATTEMPT_S = 1.0


async def open_connection(host: str, port: int, timeout: float | None = None) -> socket.socket:
    """Connect a non-blocking TCP socket to ``host:port`` within ``timeout``
    (Dask's connect timeout by default).

    An attempt that gets no answer is abandoned for a fresh socket after 1,
    then 2, 4, ... seconds, as Dask's own connect retries ``tcp://``: on one
    socket a lost SYN waits for the kernel's retransmissions (Linux's six
    retries take 127 s), longer than Dask's connect timeout. A refusal ends
    the attempts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (connect_timeout() if timeout is None else timeout)
    error: OSError | None = None
    for family, type_, proto, _, address in await _resolve(loop, host, port):
        patience = FIRST_ATTEMPT_S
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                await asyncio.wait_for(loop.sock_connect(sock, address), min(patience, remaining))
            except asyncio.TimeoutError:
                sock.close()
                error = TimeoutError(f"no answer from {host}:{port} within {patience:g} s")
                patience *= 2
                continue
            except OSError as e:
                sock.close()
                error = e
                break
            except BaseException:
                sock.close()
                raise
            configure_socket(sock)
            return sock
    raise error or OSError(f"cannot resolve {host!r}")


async def _resolve(
    loop: asyncio.AbstractEventLoop, host: str, port: int
) -> list[tuple[Any, ...]]:
    """Addresses for ``host:port``. A numeric host is parsed on the spot: the
    executor that resolves names refuses work during interpreter shutdown,
    when Dask still closes comms and may connect to say goodbye."""
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM,
            flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
        )
    except socket.gaierror:
        pass
    try:
        return await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except RuntimeError as e:
        raise OSError(f"cannot resolve {host!r}: {e}") from e


def bind(host: str | None, port: int, backlog: int) -> socket.socket:
    """A listening non-blocking socket; IPv4 first where the name has both."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def address_of(sockaddr: Any) -> str:
    """The lci:// address of an IP socket address (empty for any other socket)."""
    if not isinstance(sockaddr, tuple):
        return ""
    return "lci://" + unparse_host_port(sockaddr[0], sockaddr[1])


class TcpDevice(Device):
    provider = "tcp"

    def __init__(self, sock: socket.socket, options: DeviceOptions) -> None:
        super().__init__(options, address_of(sock.getsockname()), address_of(sock.getpeername()))
        self._sock = sock
        self._fd = sock.fileno()

    def fileno(self) -> int:
        return self._fd

    def _transmit(self, buffers: deque[Any]) -> int:
        if len(buffers) > IOV_MAX:
            return self._sock.sendmsg(list(islice(buffers, IOV_MAX)))
        return self._sock.sendmsg(buffers)

    def _receive_into(self, buffer: memoryview) -> int:
        return self._sock.recv_into(buffer)

    def _shutdown(self, both: bool) -> None:
        shut_socket(self._sock, both)

    def _close_transport(self) -> None:
        self._sock.close()


class TcpProvider(Provider):
    """The bootstrap: a listener's TCP port, and a socket per device."""

    name = "tcp"

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        sock = bind(host, port, int(dask.config.get("distributed.comm.socket-backlog")))
        bound = sock.getsockname()[:2]
        where = address_of(bound)

        def adopt(conn: socket.socket) -> None:
            try:
                configure_socket(conn)
                device = TcpDevice(conn, options)
            except OSError as e:
                logger.info("dropping connection accepted by %s: %s", where, e)
                conn.close()
                return
            accepted(device)

        return Offering(close=watch_accepts(sock, adopt, where), address=bound)

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        sock = await open_connection(peer.host, peer.port)
        try:
            return TcpDevice(sock, options)
        except BaseException:
            sock.close()
            raise


PROVIDER = TcpProvider()
