"""Socket helpers of the providers: TCP sockets configured, connected and
bound as the tcp fabric uses them; accepting what waits on a listening socket
(the tcp fabric's, from its progress; shm's handshake socket, from the event
loop); ending a socket's output whatever state it is in."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.comm.addressing import unparse_host_port

from dask_lcicomm.providers.base import Device, connect_timeout

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


def shut_socket(sock: socket.socket, both: bool) -> None:
    """End a socket's output (and input if ``both``), whatever state it is in."""
    try:
        sock.shutdown(socket.SHUT_RDWR if both else socket.SHUT_WR)
    except OSError:
        pass


def accept_ready(
    sock: socket.socket, adopt: Callable[[socket.socket], None], where: str
) -> None:
    """Accept the connections waiting on ``sock`` (a bounded batch)."""
    for _ in range(64):
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            logger.warning("accept on %s failed: %s", where, e)
            return
        conn.setblocking(False)
        adopt(conn)


def watch_accepts(
    sock: socket.socket, adopt: Callable[[socket.socket], None], where: str
) -> Callable[[], None]:
    """Accept on the listening ``sock`` from the running event loop; the
    returned function stops and closes it (as does a failure to start)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_reader(sock.fileno(), accept_ready, sock, adopt, where)
    except BaseException:
        sock.close()
        raise

    def close() -> None:
        loop.remove_reader(sock.fileno())
        sock.close()

    return close


def accept_handshakes(
    sock: socket.socket,
    handshake: Callable[[socket.socket], Awaitable[Device]],
    accepted: Callable[[Device], None],
    where: str,
) -> Callable[[], None]:
    """Run ``handshake`` on every connection accepted on ``sock`` and pass
    the device it makes to ``accepted``; a handshake that raises
    ``ConnectionError`` refuses that peer alone. The returned function stops
    accepting and cancels the handshakes under way."""
    loop = asyncio.get_running_loop()
    handshakes: set[asyncio.Task[None]] = set()

    async def run(conn: socket.socket) -> None:
        try:
            device = await handshake(conn)
        except (ConnectionError, asyncio.TimeoutError) as e:
            logger.info("refusing a peer on %s: %s", where, e)
            conn.close()
            return
        except BaseException:
            conn.close()
            raise
        accepted(device)

    def adopt(conn: socket.socket) -> None:
        task = loop.create_task(run(conn))
        handshakes.add(task)
        task.add_done_callback(handshakes.discard)

    stop_accepting = watch_accepts(sock, adopt, where)

    def close() -> None:
        stop_accepting()
        for task in list(handshakes):
            task.cancel()

    return close
