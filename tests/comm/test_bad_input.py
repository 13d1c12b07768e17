"""Hostile or broken peers: one connection closes, nothing else notices."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from distributed.comm import CommClosedError, connect, listen
from distributed.utils_test import gen_test

from dask_lcicomm.link_protocol import Greeting
from dask_lcicomm.parcel import HEADER, MAGIC, VERSION, Kind, Limits, encode_connect, encode_hello
from dask_lcicomm.providers.message_tags import CONTROL, STREAM, peer_route, tag
from dask_lcicomm.providers.tcp_connection import PREFACE

#: The tcp fabric's message header: tag, length.
_FRAME = struct.Struct("<QQ")

HELLO = encode_hello(Greeting(0, "test", Limits(), {}).encode())


async def _echo(comm):
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass


async def _raw_connection(address: str) -> tuple[socket.socket, int]:
    """A connection to the listener at ``address`` as far as the tcp
    fabric goes (the preface, a hello, the welcome read), and the route of
    the device it was welcomed to: what :func:`_stream` frames for that
    route goes into the device's parcel stream."""
    loop = asyncio.get_running_loop()
    host, port = address.removeprefix("lci://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    hello = json.dumps({"address": "", "listener": 0, "route": 7,
                        "local": "lci://a:1", "peer": "lci://b:1"}).encode()
    await loop.sock_sendall(sock, PREFACE + _FRAME.pack(tag(0, CONTROL, 0), len(hello)) + hello)
    answer = b""
    while len(answer) < len(PREFACE) + _FRAME.size + 4:
        answer += await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)
    _, nbytes = _FRAME.unpack_from(answer, len(PREFACE))
    start = len(PREFACE) + _FRAME.size
    sock.setblocking(True)
    return sock, peer_route(np.frombuffer(answer[start : start + nbytes], np.uint8))


def _stream(route: int, data: bytes) -> bytes:
    """``data`` as one stream message to the device of ``route``."""
    return _FRAME.pack(tag(route, STREAM, 0), len(data)) + data


async def _closed_by_listener(sock: socket.socket, timeout: float = 5) -> bool:
    """Whether the listener closes ``sock`` within ``timeout``."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), deadline - time.monotonic())
        except ConnectionResetError:
            return True
        except asyncio.TimeoutError:
            return False
        if not data:
            return True
    return False


async def _serves_on(address: str) -> None:
    """The listener at ``address`` still opens comms that work."""
    comm = await connect(address)
    await comm.write(1)
    assert await comm.read() == 1
    await comm.close()


def _header(kind: int, vc: int = 0, seq: int = 0, count: int = 0, magic=MAGIC, version=VERSION, flags=0):
    return HEADER.pack(magic, version, kind, flags, vc, seq, count)


BAD_STREAMS = {
    "garbage": os.urandom(64) + b"\xff" * 64,
    "bad-magic": _header(Kind.HELLO, magic=b"XXXX"),
    "bad-version": _header(Kind.HELLO, version=99),
    "unknown-kind": _header(77),
    "reserved-flags": _header(Kind.HELLO, flags=1),
    "parcel-before-hello": _header(Kind.PARCEL, vc=1, count=0),
    "absurd-frame-count": HELLO + encode_connect(1) + _header(Kind.PARCEL, vc=1, count=2**31),
    "absurd-frame-size": HELLO
    + encode_connect(1)
    + _header(Kind.PARCEL, vc=1, count=1)
    + struct.pack("<Q", (1 << 63) | (1 << 62)),
    "absurd-eager-size": HELLO
    + encode_connect(1)
    + _header(Kind.PARCEL, vc=1, count=1)
    + struct.pack("<Q", 1 << 40),
    "fragment-without-parcel": HELLO + encode_connect(1) + _header(Kind.FRAGMENT, vc=1) + b"\0" * 16,
    "out-of-sequence": HELLO + encode_connect(1) + _header(Kind.PARCEL, vc=1, seq=5, count=0),
    "hello-not-json": encode_hello(b"\xff\xfe not json"),
    "second-hello": HELLO + HELLO,
    "hello-without-limits": encode_hello(json.dumps({"pid": 0, "host": "test"}).encode()),
    "hello-with-zero-limits": encode_hello(
        json.dumps({"limits": {"max_message_bytes": 0, "max_frames": 1, "max_eager_bytes": 1}}).encode()
    ),
    "double-connect": HELLO + encode_connect(1) + encode_connect(1),
}


@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
@gen_test(timeout=30)
async def test_bad_stream_closes_only_that_connection(name, caplog):
    async with listen("lci://127.0.0.1:0", _echo) as listener:
        good = await connect(listener.contact_address)
        await good.write({"before": name})
        assert await good.read() == {"before": name}

        bad, route = await _raw_connection(listener.contact_address)
        try:
            with caplog.at_level(logging.WARNING, logger="dask_lcicomm"):
                bad.sendall(_stream(route, BAD_STREAMS[name]))
                assert await _closed_by_listener(bad), f"{name}: connection left open"
            reasons = [r.getMessage() for r in caplog.records if r.name.startswith("dask_lcicomm")]
            assert len(reasons) == 1, reasons
            assert "closing lci connection" in reasons[0] or "protocol error" in reasons[0]
        finally:
            bad.close()

        # The listener and the other comm carry on.
        await good.write({"after": name})
        assert await good.read() == {"after": name}
        other = await connect(listener.contact_address)
        await other.write("new comm")
        assert await other.read() == "new comm"
        await other.close()
        await good.close()


@gen_test(timeout=30)
async def test_truncated_parcel_then_eof_closes_connection(caplog):
    async with listen("lci://127.0.0.1:0", _echo) as listener:
        bad, route = await _raw_connection(listener.contact_address)
        try:
            with caplog.at_level(logging.INFO, logger="dask_lcicomm"):
                bad.sendall(_stream(route, HELLO + encode_connect(1)
                                    + _header(Kind.PARCEL, vc=1, count=3)[:-2]))
                bad.shutdown(socket.SHUT_WR)
                assert await _closed_by_listener(bad)
            assert any("lost" in r.getMessage() for r in caplog.records)
        finally:
            bad.close()
        await _serves_on(listener.contact_address)


#: A length of 4 TiB, in a parcel's size table or in the header of the message that carries it.
_ABSURD = {
    "in-a-parcel": lambda route: _stream(route, HELLO + encode_connect(1)
                                         + _header(Kind.PARCEL, vc=1, count=1)
                                         + struct.pack("<Q", (1 << 63) | (4 << 40))),
    "in-a-message-header": lambda route: _FRAME.pack(tag(route, STREAM, 0), 4 << 40),
}


@pytest.mark.parametrize("where", sorted(_ABSURD))
@gen_test(timeout=30)
async def test_absurd_length_is_not_allocated(where):
    """Refused before anything is allocated; only that connection closes."""
    import tracemalloc

    async with listen("lci://127.0.0.1:0", _echo) as listener:
        good = await connect(listener.contact_address)
        bad, route = await _raw_connection(listener.contact_address)
        tracemalloc.start()
        try:
            bad.sendall(_ABSURD[where](route))
            assert await _closed_by_listener(bad)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            bad.close()
        assert peak < 64 << 20
        await good.write("still here")
        assert await good.read() == "still here"
        await good.close()


@gen_test(timeout=30)
async def test_a_peer_without_the_preface_is_closed_at_once(caplog):
    async with listen("lci://127.0.0.1:0", _echo) as listener:
        host, port = listener.contact_address.removeprefix("lci://").rsplit(":", 1)
        bad = socket.create_connection((host, int(port)), timeout=5)
        try:
            with caplog.at_level(logging.WARNING, logger="dask_lcicomm"):
                bad.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert await _closed_by_listener(bad, timeout=2)
            assert any("not an lci:// endpoint" in r.getMessage() for r in caplog.records)
        finally:
            bad.close()
        await _serves_on(listener.contact_address)


_VICTIM = """
import asyncio, sys
from distributed.comm import connect
async def main():
    comm = await connect(sys.argv[1])
    await comm.write("ready")
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@gen_test(timeout=60)
async def test_dead_peer_yields_comm_closed_promptly():
    accepted: asyncio.Queue = asyncio.Queue()

    async with listen("lci://127.0.0.1:0", accepted.put) as listener:
        proc = subprocess.Popen([sys.executable, "-c", _VICTIM, listener.contact_address])
        try:
            comm = await asyncio.wait_for(accepted.get(), 30)
            assert await asyncio.wait_for(comm.read(), 30) == "ready"
            reader = asyncio.ensure_future(comm.read())
            await asyncio.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(reader, 10)
            assert time.monotonic() - start < 5
            with pytest.raises(CommClosedError):
                await comm.write("anyone?")
            await comm.close()
        finally:
            proc.kill()
            proc.wait(timeout=10)
