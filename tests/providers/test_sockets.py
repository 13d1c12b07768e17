"""Accepting on a listening socket from the event loop: a peer whose
handshake fails is refused alone; closing stops accepting and cancels the
handshakes under way."""

from __future__ import annotations

import asyncio
import socket

from distributed.utils_test import gen_test

from dask_lcicomm.providers.sockets import accept_handshakes, shut_socket


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


async def _connect(address: tuple[str, int], greeting: bytes) -> socket.socket:
    loop = asyncio.get_running_loop()
    conn = socket.socket()
    conn.setblocking(False)
    await loop.sock_connect(conn, address)
    await loop.sock_sendall(conn, greeting)
    return conn


@gen_test()
async def test_a_failed_handshake_refuses_that_peer_alone():
    loop = asyncio.get_running_loop()
    sock = _listening()
    address = sock.getsockname()
    accepted: asyncio.Queue = asyncio.Queue()

    async def handshake(conn: socket.socket) -> object:
        greeting = await loop.sock_recv(conn, 16)
        if greeting != b"hello":
            raise ConnectionError(f"bad greeting {greeting!r}")
        return conn

    close = accept_handshakes(sock, handshake, accepted.put_nowait, "test")
    try:
        bad = await _connect(address, b"garbage")
        good = await _connect(address, b"hello")
        peer = await asyncio.wait_for(accepted.get(), 5)
        # The refused connection was closed: its peer reads the end.
        assert await asyncio.wait_for(loop.sock_recv(bad, 1), 5) == b""
        assert peer.fileno() >= 0 and accepted.empty()
        peer.close()
        for conn in (bad, good):
            conn.close()
    finally:
        close()
    assert sock.fileno() == -1  # the listening socket is closed with it


@gen_test()
async def test_closing_cancels_the_handshakes_under_way():
    loop = asyncio.get_running_loop()
    sock = _listening()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handshake(conn: socket.socket) -> object:
        started.set()
        try:
            await loop.sock_recv(conn, 16)  # the peer never greets
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    close = accept_handshakes(sock, handshake, lambda device: None, "test")
    conn = await _connect(sock.getsockname(), b"")
    await asyncio.wait_for(started.wait(), 5)
    close()
    await asyncio.wait_for(cancelled.wait(), 5)
    # ... and the connection it held is closed, not leaked.
    assert await asyncio.wait_for(loop.sock_recv(conn, 1), 5) == b""
    conn.close()


def test_shutting_a_socket_in_any_state_does_not_raise():
    a, b = socket.socketpair()
    shut_socket(a, both=False)
    assert b.recv(1) == b""
    a.close()
    shut_socket(a, both=True)  # closed already
    with socket.socket() as never_connected:
        shut_socket(never_connected, both=True)
    b.close()
