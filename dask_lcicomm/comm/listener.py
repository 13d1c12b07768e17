"""LCIListener: accepts lci:// connections on a TCP port."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import Callable
from typing import Any

import dask.config
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, CommClosedError
from distributed.comm.utils import ensure_concrete_host

from dask_lcicomm.comm.comm import LCIComm
from dask_lcicomm.comm.security import check_encryption
from dask_lcicomm.parcelport import SCHEME, Parcelport
from dask_lcicomm.providers import shm

logger = logging.getLogger("dask_lcicomm.comm")


class LCIListener(BaseListener):
    """Listens on a TCP port; each accepted socket becomes a device of the parcelport.

    Comms reach the handler as virtual connections opened over those devices.
    """

    prefix = SCHEME

    def __init__(
        self,
        address: str,
        comm_handler: Callable[[LCIComm], Any],
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        check_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._sock: socket.socket | None = None
        self._parcelport: Parcelport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bound: tuple[str, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._shm_sock: socket.socket | None = None
        self.shm_name: str | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._parcelport = Parcelport.current()
        self._sock = _bind(self.ip, self.port)
        self._bound = self._sock.getsockname()[:2]
        self._parcelport.add_listener(self)
        self._loop.add_reader(self._sock.fileno(), self._accept)
        if self._parcelport.shm_unavailable is None:
            self._shm_sock, self.shm_name = shm.listen(_backlog())
            self._loop.add_reader(self._shm_sock.fileno(), self._accept_shm)

    def _accept(self) -> None:
        if self._parcelport is not None:
            self._accept_from(self._sock, self._parcelport.accept)

    def _accept_shm(self) -> None:
        if self._parcelport is not None:
            self._accept_from(self._shm_sock, self._parcelport.accept_shm)

    def _accept_from(
        self, sock: socket.socket | None, adopt: Callable[[socket.socket, LCIListener], None]
    ) -> None:
        if sock is None:
            return
        for _ in range(64):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("accept on %s failed: %s", self.contact_address, e)
                return
            conn.setblocking(False)
            adopt(conn, self)

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        assert self._loop is not None and self._parcelport is not None
        self._loop.remove_reader(sock.fileno())
        sock.close()
        shm_sock, self._shm_sock = self._shm_sock, None
        if shm_sock is not None:
            self._loop.remove_reader(shm_sock.fileno())
            shm_sock.close()
        self._parcelport.remove_listener(self)

    def handle(self, comm: LCIComm) -> None:
        """Run the Dask handshake and the handler for a new virtual connection."""
        assert self._loop is not None
        task = self._loop.create_task(self._handle(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, comm: LCIComm) -> None:
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("connection from %s closed before handshake completed", comm.peer_address)
            return
        result = self.comm_handler(comm)
        if inspect.isawaitable(result):
            await result

    def get_host_port(self) -> tuple[str, int]:
        if self._bound is None:
            raise ValueError("invalid operation on non-started LCIListener")
        return self._bound

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)


def _backlog() -> int:
    return int(dask.config.get("distributed.comm.socket-backlog"))


def _bind(ip: str | None, port: int) -> socket.socket:
    infos = socket.getaddrinfo(
        ip or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_backlog())
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
