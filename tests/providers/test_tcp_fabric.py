"""The tcp fabric's verbs on their own: framing, truncation, gathered writes,
and the peers it closes at once (what every message fabric must do is in
test_message_fabric.py and test_message_device.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

import dask
import numpy as np
import pytest
from distributed.utils_test import gen_test

from dask_lcicomm.providers.message_routes import Listener
from dask_lcicomm.providers.tcp_connection import PREFACE
from dask_lcicomm.providers.tcp_fabric import TcpFabric

_HEADER = struct.Struct("<QQ")


class _Progress:
    """What a fabric asks of its engine, doing nothing."""

    def want_write(self, device):
        pass

    def hold(self, source):
        return True

    def drop(self, source):
        pass

    def kick(self, source):
        pass


def _listener():
    def refuse(*args):
        raise ValueError("no devices here")

    return Listener(refuse, refuse)


@contextlib.contextmanager
def _fabric():
    fabric = TcpFabric(asyncio.get_running_loop(), _Progress())
    try:
        _, address = fabric.bind_listener(_listener(), "127.0.0.1", 0)
        yield fabric, address
    finally:
        with fabric.lock:
            fabric.cancel_all()


async def _until(fabric, predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        with fabric.lock:
            fabric.poke()
        await asyncio.sleep(0.001)


async def _taken(fabric):
    """The next message taken off ``fabric``: tag, length, handle, bytes."""
    taken = []
    await _until(fabric, lambda: bool(taken.append(fabric.take()) or taken[-1]))
    return taken[-1]


async def _received(fabric, message, nbytes: int) -> bytes:
    """``message`` received into a buffer of ``nbytes``."""
    buffer = np.zeros(nbytes, np.uint8)
    request = fabric.receive(message, buffer)
    await _until(fabric, lambda: request.completed)
    request.check_error()
    return bytes(buffer)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (anything it wrote first is read)."""
    try:
        while data := sock.recv(4096):
            assert data.startswith(PREFACE) or not data, data
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _raw_peer(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    sock.setblocking(False)
    return sock


@gen_test(timeout=30)
async def test_a_message_is_framed_and_a_short_receive_truncates_it():
    """A message larger than the stage is received; a short buffer
    truncates it and the rest is skipped. One staged whole comes with its
    bytes, writable."""
    large = np.arange(100_000, dtype=np.uint8).tobytes()
    with _fabric() as (fabric, address):
        peer = _raw_peer(address)
        peer.setblocking(True)
        peer.sendall(PREFACE + _HEADER.pack(7, len(large)) + large + _HEADER.pack(8, 3) + b"abc")
        tag, nbytes, message, data = await _taken(fabric)
        assert (tag, nbytes, data) == (7, len(large), None)
        assert await _received(fabric, message, 8) == large[:8]
        tag, nbytes, message, data = await _taken(fabric)
        assert (tag, nbytes) == (8, 3)
        assert isinstance(data, bytearray) and data == b"abc"
        peer.close()


@gen_test(timeout=30)
async def test_messages_staged_whole_are_taken_in_order_up_to_one_that_is_not():
    with _fabric() as (fabric, address):
        peer = _raw_peer(address)
        peer.setblocking(True)
        peer.sendall(PREFACE + _HEADER.pack(1, 2) + b"ab" + _HEADER.pack(2, 0)
                     + _HEADER.pack(3, 1 << 20) + b"x" * 10)
        first, second, third = [await _taken(fabric) for _ in range(3)]
        assert [first[::3], second[::3]] == [(1, b"ab"), (2, b"")]
        assert (third[0], third[1], third[3]) == (3, 1 << 20, None)
        # Nothing behind a message taken without its bytes until it is received.
        peer.sendall(b"x" * ((1 << 20) - 10) + _HEADER.pack(4, 1) + b"y")
        with fabric.lock:
            fabric.poke()
        assert fabric.take() is None
        assert await _received(fabric, third[2], 1 << 20) == b"x" * (1 << 20)
        assert (await _taken(fabric))[::3] == (4, b"y")
        peer.close()


@gen_test(timeout=30)
async def test_a_message_that_fits_the_stage_is_taken_whole_however_it_arrives():
    """Its header and first bytes staged, the rest still to come: it waits
    in the stage and is taken with its bytes, not received apart."""
    body = bytes(range(256)) * 64
    with _fabric() as (fabric, address):
        peer = _raw_peer(address)
        peer.setblocking(True)
        peer.sendall(PREFACE + _HEADER.pack(5, len(body)) + body[:1000])
        for _ in range(5):
            await asyncio.sleep(0.01)
            with fabric.lock:
                fabric.poke()
            assert fabric.take() is None
        peer.sendall(body[1000:])
        tag, nbytes, _, data = await _taken(fabric)
        assert (tag, nbytes) == (5, len(body)) and data == body
        peer.close()


@gen_test(timeout=30)
async def test_a_length_off_the_wire_is_handed_on_not_allocated():
    """A header may claim any length: the fabric reports it and keeps no
    more than its stage; the router checks it before anything is allocated."""
    with _fabric() as (fabric, address):
        peer = _raw_peer(address)
        peer.sendall(PREFACE + _HEADER.pack(1, 1 << 62))
        assert (await _taken(fabric))[1] == 1 << 62
        peer.close()


@gen_test(timeout=30)
async def test_a_peer_that_is_not_lci_is_closed_at_once_and_the_listener_serves_on():
    with _fabric() as (fabric, address):
        stranger = _raw_peer(address)
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
        await _until(fabric, lambda: _closed_by_peer(stranger))
        peer = _raw_peer(address)
        peer.sendall(PREFACE + _HEADER.pack(3, 0))
        assert (await _taken(fabric))[:2] == (3, 0)
        stranger.close()
        peer.close()


@gen_test(timeout=30)
async def test_a_connection_to_a_server_that_is_not_lci_fails_its_watchers_at_once():
    server = socket.create_server(("127.0.0.1", 0))
    with _fabric() as (fabric, _), server:
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        failed = []
        with fabric.lock:
            handle = fabric.adopt(client)
            fabric.watch_peer(handle, lambda: failed.append(True))
        await _until(fabric, lambda: bool(failed))
        conn.close()


@gen_test(timeout=30)
async def test_an_accepted_connection_that_never_says_hello_is_closed():
    with dask.config.set({"distributed.comm.timeouts.connect": "0.2s"}), _fabric() as (fabric, address):
        silent = _raw_peer(address)
        await _until(fabric, lambda: bool(fabric._connections))
        await _until(fabric, lambda: not fabric._connections)
        silent.close()


@gen_test(timeout=30)
async def test_a_list_of_buffers_is_one_message_written_from_where_they_lie():
    """A bulk group of several buffers (a large frame's shards) is sent as
    one message, gathered: the caller's buffers are written, never joined."""
    with _fabric() as (fabric, address):
        sender = socket.create_connection(address)
        written = []

        class Recording:
            """The connection's socket, recording what each write was given."""

            def __getattr__(self, name):
                return getattr(sender, name)

            def sendmsg(self, buffers):
                written.extend(buffers)
                return sender.sendmsg(buffers)

        parts = [bytearray(b"ab"), bytearray(), bytearray(b"cd")]
        with fabric.lock:
            handle = fabric.adopt(sender)
            handle.sock = Recording()
            request = fabric.send(handle, 5, parts)
        assert (await _taken(fabric))[::3] == (5, b"abcd")
        assert request.completed
        assert any(isinstance(b, memoryview) and b.obj is parts[0] for b in written)


@gen_test(timeout=30)
async def test_sends_queued_behind_a_full_socket_are_written_together():
    """A large message fills the socket; the small ones queued behind it go
    out in a few writes, not one each. The fabric writes to its own listener."""
    with _fabric() as (fabric, address):
        sender = socket.create_connection(address)
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        writes = []

        class Counting:
            """The connection's socket, counting its writes."""

            def __getattr__(self, name):
                return getattr(sender, name)

            def sendmsg(self, buffers):
                writes.append(len(buffers))
                return sender.sendmsg(buffers)

        with fabric.lock:
            handle = fabric.adopt(sender)
            handle.sock = Counting()
            requests = [fabric.send(handle, 1, np.zeros(8 << 20, np.uint8))]
            requests += [fabric.send(handle, 2, np.full(10, i, np.uint8)) for i in range(200)]
        tags = []

        def drained():
            while (taken := fabric.take()) is not None:
                tags.append(taken[0])
                if taken[3] is None:
                    fabric.receive(taken[2], np.empty(min(taken[1], 16), np.uint8))
            return all(r.completed for r in requests) and len(tags) == 201

        await _until(fabric, drained, timeout=20)
        assert tags == [1] + [2] * 200
        assert len(writes) < 100, f"{len(writes)} writes for 201 messages"


@gen_test(timeout=30)
async def test_a_peer_that_closes_fails_the_sends_left_and_tells_the_watchers():
    with _fabric() as (fabric, _):
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        failed = []
        with fabric.lock:
            handle = fabric.adopt(client)
            fabric.watch_peer(handle, lambda: failed.append(True))
            request = fabric.send(handle, 1, np.zeros(16 << 20, np.uint8))
        assert not request.completed
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        server.close()
        await _until(fabric, lambda: request.completed and bool(failed))
        with pytest.raises(OSError):
            request.check_error()


@gen_test(timeout=30)
async def test_closing_a_connection_again_spares_the_one_that_reuses_its_descriptor():
    """A connection closed once may be closed again (its peer's end read
    later): the descriptor's number may be a new connection's by then."""
    with _fabric() as (fabric, address):
        with fabric.lock:
            old = fabric.adopt(socket.create_connection(address))
            fabric.close_peer(old)
            new = fabric.adopt(socket.create_connection(address))
        if new.fd != old.fd:
            pytest.skip("the kernel gave the new socket another descriptor")
        with fabric.lock:
            fabric._close(old, ConnectionResetError("read late"))
        assert fabric._connections.get(new.fd) is new
        assert new.error is None


@gen_test(timeout=30)
async def test_a_connection_accepted_by_a_progress_thread_still_expires():
    """Progress may run on a thread of its own: the expiry timer is set on
    the event loop's (asyncio's debug mode refuses it from another thread)."""
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "0.2s"}), \
                _fabric() as (fabric, address):
            silent = _raw_peer(address)

            def poke():
                with fabric.lock:
                    fabric.poke()

            deadline = time.monotonic() + 5
            while not fabric._connections:
                assert time.monotonic() < deadline, "never accepted"
                await asyncio.to_thread(poke)
            await _until(fabric, lambda: not fabric._connections)
            silent.close()
    finally:
        loop.set_debug(False)
