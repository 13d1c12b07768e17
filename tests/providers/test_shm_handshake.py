"""The shm provider's handshake: two processes prove that they share memory,
and anything else (another process, another user, nobody, a malformed grant)
is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

import pytest
from distributed.utils_test import gen_test

from dask_lcicomm.providers import shm_handshake
from dask_lcicomm.providers.registry import ProviderUnavailable
from dask_lcicomm.providers.shm_segment import PAGE, Layout, create

LAYOUT = Layout(PAGE, 4 * PAGE, 8)


def _connect(names, peer_pid=None, reads=False):
    """The connecting end, as "lci://c:1" to a listener at "lci://l:2"."""
    return shm_handshake.connect(names, peer_pid, LAYOUT, "lci://c:1", "lci://l:2", 5, reads)


class Listening:
    """An abstract socket whose accepted connections run ``shm_handshake.accept``."""

    def __init__(self, reads=False, host=None, port=0):
        self.reads = reads
        self.sock, self.name = shm_handshake.listen(8, host, port)
        self.results: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._accept)
        self._tasks = set()

    def _accept(self):
        conn, _ = self.sock.accept()
        conn.setblocking(False)
        task = asyncio.ensure_future(self._answer(conn))
        self._tasks.add(task)

    async def _answer(self, conn):
        try:
            await self.results.put(await shm_handshake.accept(conn, LAYOUT, 5, self.reads))
        except ProviderUnavailable as e:
            conn.close()
            await self.results.put(e)

    def close(self):
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()


@gen_test(timeout=30)
async def test_handshake_links_two_ends_that_share_memory():
    listening = Listening()
    try:
        near = await _connect((listening.name,), os.getpid())
        far = await listening.results.get()
        assert (far.local_address, far.peer_address) == ("lci://l:2", "lci://c:1")
        near.tx.write(LAYOUT.pool_offset, b"to far")
        out = bytearray(6)
        far.rx.read_into(LAYOUT.pool_offset, out)
        assert out == b"to far"
        for link in (near, far):
            link.sock.close()
    finally:
        listening.close()


async def _linked(near_reads, far_reads):
    """Both ends of a handshake in this process, each offering reads or not."""
    listening = Listening(far_reads)
    try:
        near = await _connect((listening.name,), os.getpid(), near_reads)
        far = await listening.results.get()
    finally:
        listening.close()
    for link in (near, far):
        link.sock.close()
        assert link.peer_pid == os.getpid()
    return near, far


@pytest.mark.parametrize("near_reads, far_reads", [(True, True), (True, False), (False, True)])
@gen_test(timeout=30)
async def test_each_end_says_whether_it_reads_the_other(near_reads, far_reads):
    near, far = await _linked(near_reads, far_reads)
    assert (near.reads, near.peer_reads) == (near_reads, far_reads)
    assert (far.reads, far.peer_reads) == (far_reads, near_reads)


@gen_test(timeout=30)
async def test_an_end_the_kernel_does_not_let_read_its_peer_offers_no_reads(monkeypatch, caplog):
    monkeypatch.setattr(shm_handshake, "unreadable", lambda pid: "process_vm_readv: Operation not permitted")
    with caplog.at_level(logging.INFO, "dask_lcicomm"):
        near, far = await _linked(True, True)
    assert not (near.reads or near.peer_reads or far.reads or far.peer_reads)
    assert "go through the ring: process_vm_readv: Operation not permitted" in caplog.text


@gen_test(timeout=30)
async def test_handshake_refuses_another_process_than_the_greeter():
    listening = Listening()
    try:
        with pytest.raises(ProviderUnavailable, match="belongs to pid"):
            await _connect((listening.name,), os.getpid() + 1)
    finally:
        listening.close()


@gen_test(timeout=30)
async def test_handshake_refuses_another_user(monkeypatch):
    listening = Listening()
    try:
        monkeypatch.setattr(shm_handshake.os, "getuid", lambda: 12345)
        with pytest.raises(ProviderUnavailable, match="runs as uid"):
            await _connect((listening.name,), os.getpid())
        refused = await listening.results.get()
        assert isinstance(refused, ProviderUnavailable) and "runs as uid" in str(refused)
    finally:
        listening.close()


@gen_test(timeout=30)
async def test_handshake_with_nobody_there():
    with pytest.raises(ProviderUnavailable, match=r"ConnectionRefused|FileNotFound"):
        await _connect(("dask-lcicomm-nobody",), os.getpid())


@pytest.mark.parametrize("bound, reached", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1")])
@gen_test(timeout=30)
async def test_a_listener_on_this_host_is_found_by_its_address(bound, reached):
    """No greeting is needed to find it: the names for the address it is
    reached at lead to it, whether it is bound to that address or to all."""
    listening = Listening(host=bound, port=40123)
    try:
        names = shm_handshake.names_for(reached, 40123)
        assert listening.name in names
        near = await _connect(names)
        far = await listening.results.get()
        assert near.peer_pid == far.peer_pid == os.getpid()
        for link in (near, far):
            link.sock.close()
    finally:
        listening.close()


@pytest.mark.parametrize("host", ["192.0.2.1", "localhost", "not an address"])
def test_no_names_for_another_host_or_a_host_name(host):
    """An address of another host (TEST-NET-1 here) could share a port
    number with a listener of this one; a name would have to be resolved."""
    assert shm_handshake.names_for(host, 40123) == ()


@gen_test(timeout=30)
async def test_a_second_listener_at_a_taken_name_gets_one_only_its_greeting_tells():
    first = Listening(host="127.0.0.1", port=40124)
    second = Listening(host="127.0.0.1", port=40124)
    try:
        assert first.name in shm_handshake.names_for("127.0.0.1", 40124)
        assert second.name not in shm_handshake.names_for("127.0.0.1", 40124)
        near = await _connect((second.name,), os.getpid())
        far = await second.results.get()
        for link in (near, far):
            link.sock.close()
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    "grant, fds, match",
    [
        (b"not json", 1, "JSONDecodeError"),
        (json.dumps({"segment": LAYOUT.describe()}).encode(), 0, "carried 0 descriptors"),
        (json.dumps({"segment": {"ring": 1}}).encode(), 1, "malformed segment"),
        (json.dumps({"segment": LAYOUT.describe(), "local": 5, "peer": "x"}).encode(), 1,
         "malformed address"),
        (json.dumps({"segment": Layout(PAGE, 8 * PAGE, 8).describe(), "local": "lci://a:1",
                     "peer": "lci://b:2"}).encode(), 1, "its layout says"),
    ],
)
@gen_test(timeout=30)
async def test_malformed_grants_are_refused(grant, fds, match):
    listening = Listening()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + listening.name)
        rights = [create(LAYOUT)[0] for _ in range(fds)]
        socket.send_fds(sock, [grant], rights)
        for fd in rights:
            os.close(fd)
        refused = await listening.results.get()
        assert isinstance(refused, ProviderUnavailable)
        assert match in str(refused)
    finally:
        sock.close()
        listening.close()
