"""The message-fabric verbs over TCP: one endpoint per progress engine, and
a connection per peer (:mod:`.tcp_connection`: messages framed over a socket).

The endpoint waits on one epoll descriptor for all its sockets: the
listening ones, one per listener, and its connections. A listener's endpoint
answers a hello over the connection it came by (:meth:`TcpFabric.answering`),
so a pair of processes costs one socket each; an accepted connection that
brings no hello within Dask's connect timeout is closed.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import select
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import dask.config
import numpy as np

from dask_lcicomm.providers import message_verbs
from dask_lcicomm.providers.base import Progress, connect_timeout
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_routes import Answer, Listener
from dask_lcicomm.providers.sockets import accept_ready, address_of, bind, configure_socket
from dask_lcicomm.providers.tcp_connection import Connection, NotAnEndpoint, Request

logger = logging.getLogger(__name__)

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT


class TcpFabric(MessageFabric):
    """An epoll descriptor over this process's sockets to its peers."""

    provider = "tcp"
    gathers = True

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> None:
        super().__init__(loop, progress)
        self._epoll = select.epoll()
        self._connections: dict[int, Connection] = {}
        #: Listening sockets by descriptor: the socket, its listener's number,
        #: what adopts a connection accepted on it, and its address.
        self._listening: dict[int, tuple[socket.socket, int, Callable[[socket.socket], None], str]] = {}
        self._taken: deque[tuple[int, int, Connection, bytearray | None]] = deque()
        self._connecting: set[Connection] = set()
        self._take = lambda *taken: self._taken.append(taken)
        # Hellos are answered over the connection they came by, not by address.
        self.address = ""

    def fileno(self) -> int:
        return self._epoll.fileno()

    # -- listening (under the lock) ----------------------------------------

    def bind_listener(self, listener: Listener, host: str | None, port: int) -> tuple[int, Any]:
        """Accept for ``listener`` at ``host:port``: its number, and the
        bound (host, port)."""
        number = self.listen(listener)
        try:
            sock = bind(host, port, int(dask.config.get("distributed.comm.socket-backlog")))
        except BaseException:
            self.stop_listening(number)
            raise
        name = sock.getsockname()
        where = address_of(name)
        adopt = functools.partial(self._accepted, number=number, where=where)
        with self.lock:
            self._listening[sock.fileno()] = (sock, number, adopt, where)
            self._epoll.register(sock.fileno(), _IN)
        return number, name[:2]

    def stop_listening(self, number: int) -> None:
        super().stop_listening(number)
        with self.lock:
            for fd, (sock, owner, _, _) in list(self._listening.items()):
                if owner == number:
                    del self._listening[fd]
                    self._epoll.unregister(fd)
                    sock.close()

    def adopt(self, sock: socket.socket) -> Any:
        """A handle for the peer at the other end of the connected ``sock``."""
        sock.setblocking(False)
        connection = Connection(sock, self._take)
        connection.handles = 1
        self._add(connection, _IN)
        return connection

    def answering(self, message: Any, hello: dict[str, Any]) -> tuple[Any, Callable[[], Answer]]:
        connection: Connection = message

        def answer() -> Answer:
            connection.handles += 1
            sock = connection.sock
            return connection, address_of(sock.getsockname()), address_of(sock.getpeername())

        return connection.listener, answer

    def _accepted(self, sock: socket.socket, number: int, where: str) -> None:
        try:
            configure_socket(sock)
        except OSError as e:
            logger.info("tcp fabric: dropping a connection accepted by %s: %s", where, e)
            sock.close()
            return
        connection = Connection(sock, self._take)
        connection.listener = number
        # A peer that never says hello must not hold a socket forever. (Progress
        # may run on its own thread: the timer is set on the event loop's.)
        self._loop.call_soon_threadsafe(self._loop.call_later, connect_timeout(), self._expire,
                                        connection)
        self._add(connection, _IN)

    def _expire(self, connection: Connection) -> None:
        with self.lock:
            if not connection.handles and connection.error is None:
                self._close(connection, TimeoutError("no hello within the connect timeout"))

    def _add(self, connection: Connection, events: int) -> None:
        """Poll ``connection``; write its preface unless it is still connecting."""
        self._connections[connection.fd] = connection
        connection.events = events
        self._epoll.register(connection.fd, events)
        if not events & _OUT:
            self._write(connection)

    # -- the verbs -------------------------------------------------------

    def open_peer(self, address: str) -> Any:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            configure_socket(sock)
            code = sock.connect_ex((host, int(port)))
            if code not in (0, errno.EINPROGRESS):
                name = errno.errorcode.get(code, str(code))
                raise ConnectionRefusedError(code, f"cannot connect to {address}: {name}")
        except BaseException:
            sock.close()
            raise
        connection = Connection(sock, self._take)
        connection.handles = 1
        self._connecting.add(connection)
        self._add(connection, _IN | _OUT)  # writable once connected
        return connection

    def watch_peer(self, peer: Any, failed: Callable[[], None]) -> None:
        if peer.error is not None:
            failed()
        else:
            peer.watchers.append(failed)

    def close_peer(self, peer: Any) -> None:
        peer.watchers.clear()
        peer.handles -= 1
        if peer.handles <= 0:
            self._close(peer, ConnectionResetError("the connection was closed"))

    def send(self, peer: Any, tag: int, message: Any) -> message_verbs.Request:
        request = peer.send(tag, message)
        if len(peer.sends) == 1 and peer not in self._connecting:
            self._write(peer)
        return request

    def take(self) -> tuple[int, int, Any, Any] | None:
        return self._taken.popleft() if self._taken else None

    def receive(self, message: Any, buffer: np.ndarray) -> Request:
        connection: Connection = message
        request = connection.receive(buffer)
        if connection.broken is not None:
            self._close(connection, connection.broken)
        return request

    def poke(self) -> None:
        for fd, events in self._epoll.poll(0):
            listening = self._listening.get(fd)
            if listening is not None:
                sock, _, adopt, where = listening
                accept_ready(sock, adopt, where)
                continue
            connection = self._connections.get(fd)
            if connection is None:
                continue
            if events & _OUT:
                self._writable(connection)
            if events & (_IN | select.EPOLLHUP | select.EPOLLERR) and connection.error is None:
                try:
                    connection.read()
                except OSError as e:
                    self._close(connection, e)

    def arm(self) -> bool:
        # Level-triggered: a socket with unread bytes keeps the descriptor
        # readable; messages taken out are not seen by it.
        return not self._taken

    def cancel_all(self) -> None:
        error = ConnectionResetError("the tcp fabric endpoint closed")
        for connection in list(self._connections.values()):
            self._close(connection, error)
        for sock, *_ in self._listening.values():
            sock.close()
        self._listening.clear()
        self._epoll.close()

    @staticmethod
    def setup_errors() -> tuple[type[BaseException], ...]:
        return (OSError, ValueError)

    # -- the connections -------------------------------------------------

    def _writable(self, connection: Connection) -> None:
        if connection in self._connecting:
            self._connecting.discard(connection)
            code = connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._close(connection, ConnectionRefusedError(code, errno.errorcode.get(code, str(code))))
                return
        self._write(connection)

    def _write(self, connection: Connection) -> None:
        try:
            connection.write()
        except OSError as e:
            self._close(connection, e)
            return
        events = _IN | _OUT if connection.sends else _IN
        if connection.events != events:
            connection.events = events
            self._epoll.modify(connection.fd, events)

    def _close(self, connection: Connection, error: BaseException) -> None:
        self._connecting.discard(connection)
        if connection.fail(error) and isinstance(error, NotAnEndpoint):
            logger.warning("tcp fabric: closing a connection whose peer is not an lci:// "
                           "endpoint: %s", error)
        # By identity: once closed, its descriptor's number may be another's.
        if self._connections.get(connection.fd) is connection:
            del self._connections[connection.fd]
            self._epoll.unregister(connection.fd)
            connection.sock.close()
