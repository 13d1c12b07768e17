"""Connecting over TCP, as the tcp provider connects
(:func:`~dask_lcicomm.providers.sockets.open_connection`): an attempt nobody
answers is retried on a fresh socket, a refusal is final, and no socket is
left behind."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from dask_lcicomm.providers import sockets


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()
    sock.close()


def _unanswered(monkeypatch, first: int) -> list[int]:
    """The first ``first`` attempts get no answer; the sockets tried, by fd."""
    tried: list[int] = []
    loop = asyncio.get_running_loop()
    real = loop.sock_connect

    async def sock_connect(sock, address):
        tried.append(sock.fileno())
        if len(tried) <= first:
            await asyncio.sleep(3600)
        return await real(sock, address)

    monkeypatch.setattr(loop, "sock_connect", sock_connect)
    return tried


def test_an_unanswered_attempt_is_retried_on_a_fresh_socket(monkeypatch, listener):
    async def main():
        tried = _unanswered(monkeypatch, first=1)
        before = _fds()
        start = time.monotonic()
        sock = await sockets.open_connection(*listener, timeout=10)
        took = time.monotonic() - start
        sock.close()
        return tried, took, _fds() - before

    tried, took, leaked = asyncio.run(main())
    assert len(tried) == 2 and sockets.FIRST_ATTEMPT_S <= took < sockets.FIRST_ATTEMPT_S + 2
    assert leaked == 0


def test_nobody_answering_is_a_timeout_at_the_deadline_with_every_socket_closed(monkeypatch, listener):
    async def main():
        tried = _unanswered(monkeypatch, first=100)
        before = _fds()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer"):
            await sockets.open_connection(*listener, timeout=2.5)
        return tried, time.monotonic() - start, _fds() - before

    tried, took, leaked = asyncio.run(main())
    # 1 s, then 2 s cut to the 1.5 s left
    assert len(tried) == 2 and 2.4 < took < 4.5 and leaked == 0


def test_a_refusal_is_final():
    async def main():
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
        probe.close()  # nobody listens there now
        start = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            await sockets.open_connection(*address, timeout=10)
        return time.monotonic() - start

    assert asyncio.run(main()) < sockets.FIRST_ATTEMPT_S
