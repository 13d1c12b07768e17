"""The TCP provider: works between any two hosts.

The one-sided put is emulated: the receiver's progress reads each bulk
fragment straight into the buffer allocated from the parcel's header (see
:class:`~dask_lcicomm.parcel.ParcelDecoder`), and the sender hands the kernel
the caller's own buffers with ``sendmsg`` (scatter-gather), so large frames
are copied by nobody but the kernel.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from itertools import islice
from typing import Any

import dask.config
from dask.utils import parse_timedelta

from dask_lcicomm.providers.base import IOV_MAX, Device, shut_socket


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


async def open_connection(host: str, port: int) -> socket.socket:
    """Connect a non-blocking TCP socket to ``host:port``."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        configure_socket(sock)
        return sock
    raise error or OSError(f"cannot resolve {host!r}")


class TcpDevice(Device):
    provider = "tcp"

    def __init__(self, sock: socket.socket, **kwargs: Any) -> None:
        super().__init__(**kwargs)
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
