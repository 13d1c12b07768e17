"""Socket helpers of the stream providers (tcp, and shm's handshake socket):
accepting on a listening socket from the event loop, and ending a socket's
output whatever state it is in."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from dask_lcicomm.providers.base import Device

logger = logging.getLogger(__name__)


def shut_socket(sock: socket.socket, both: bool) -> None:
    """End a socket's output (and input if ``both``), whatever state it is in."""
    try:
        sock.shutdown(socket.SHUT_RDWR if both else socket.SHUT_WR)
    except OSError:
        pass


def _accept_ready(
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
        loop.add_reader(sock.fileno(), _accept_ready, sock, adopt, where)
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
