"""Providers between real processes (shared memory, UCX, libfabric): a peer
killed in the middle of a 64 MiB transfer, a writer that never yields, and a
stress run of random traffic under back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time

import dask
import numpy as np
import pytest
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test
from ofi_support import needs_ofi
from ucx_support import needs_ucx

MiB = 1 << 20

_PEER = """
import asyncio, sys, time
import numpy as np
from distributed.comm import connect
from distributed.protocol import to_serialize

async def main(address, role):
    comm = await connect(address)
    await comm.write(comm.extra_info["provider"])
    if role == "source":
        block = np.ones(64 << 20, dtype=np.uint8)
        while True:
            await comm.write({"data": to_serialize(block)})
    if role == "counter":
        count = 0
        while (msg := await comm.read()) != "end":
            if msg == "hold":
                time.sleep(4)  # the event loop held, as by a task holding the GIL
            else:
                count += 1
        await comm.write(count)
    while True:
        await comm.read()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

_ECHO = """
import asyncio, hashlib, sys
from distributed.comm import listen

async def echo(comm):
    while True:
        try:
            msg = await comm.read()
        except Exception:
            return
        msg["hash"] = hashlib.blake2b(memoryview(msg["payload"]).cast("B")).hexdigest()
        await comm.write(msg)

async def main():
    async with listen("lci://127.0.0.1:0", echo) as listener:
        print(listener.contact_address, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def _shm_files() -> set[str]:
    """Named shared memory, but for the semaphores of other programs'
    multiprocessing (this machine runs other work; neither process here uses
    multiprocessing)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-")}


def _mapped_shm_files() -> list[str]:
    """Our shared memory still mapped. UCX's first worker maps segments,
    unlinked at once, that UCX keeps for the life of the process (their
    number does not grow with devices: test_lifecycle counts them)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "/dev/shm/" in line and "/dev/shm/ucx_shm_posix_" not in line]


def _config(settings: dict[str, str]) -> dict[str, str]:
    """``settings`` (lci keys with underscores, ``__`` between a section and
    its option, as in environment variables) as Dask configuration."""
    return {f"distributed.comm.lci.{k.replace('__', '.').replace('_', '-')}": v for k, v in settings.items()}


def _env(**settings: str) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in settings.items():
        env[f"DASK_DISTRIBUTED__COMM__LCI__{key.upper()}"] = value
    return env


#: (lci settings, the provider they choose): shm with and without its pool
#: of blocks for large frames (without, they are read from the sender's
#: memory, or go through the ring), and UCX alone.
PEERS = [
    pytest.param({"shm__pool_size": "256MiB"}, "shm", id="shm-256MiB"),
    pytest.param({"shm__pool_size": "0"}, "shm", id="shm-0"),
    pytest.param({"shm__pool_size": "0", "shm__rendezvous_bytes": "0"}, "shm", id="shm-ring"),
    needs_ucx({"providers": "[ucx]"}, "ucx", id="ucx"),
    needs_ofi({"providers": "[ofi]"}, "ofi", id="ofi"),
]


@pytest.mark.parametrize("settings, provider", PEERS)
@pytest.mark.parametrize("direction", ["to-peer", "from-peer"])
@gen_test(timeout=120)
async def test_peer_killed_mid_transfer(direction, settings, provider):
    before = _shm_files()
    accepted: asyncio.Queue = asyncio.Queue()
    role = "sink" if direction == "to-peer" else "source"
    # Over ofi a dead peer that took sends before is told from a busy one by
    # this bound alone (libfabric answers "retry" to both).
    with dask.config.set({**_config(settings), "distributed.comm.timeouts.tcp": "4s"}):
        async with listen("lci://127.0.0.1:0", accepted.put) as listener:
            proc = subprocess.Popen(
                [sys.executable, "-c", _PEER, listener.contact_address, role], env=_env(**settings)
            )
            try:
                comm = await asyncio.wait_for(accepted.get(), 30)
                assert await asyncio.wait_for(comm.read(), 30) == provider
                assert comm.extra_info["provider"] == provider
                block = np.ones(64 * MiB, dtype=np.uint8)

                async def transfer():
                    while True:
                        if direction == "to-peer":
                            await comm.write({"data": to_serialize(block)})
                        else:
                            await comm.read()

                moving = asyncio.ensure_future(transfer())
                await asyncio.sleep(1.0)
                assert not moving.done(), moving
                os.kill(proc.pid, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(CommClosedError):
                    await asyncio.wait_for(moving, 15)
                assert time.monotonic() - killed < 15
                # the listener keeps serving
                fresh = await connect(listener.contact_address)
                other = await asyncio.wait_for(accepted.get(), 10)
                await fresh.write("still here")
                assert await other.read() == "still here"
                await fresh.close()
                await other.close()
                await comm.close()
            finally:
                proc.kill()
                proc.wait(timeout=10)
    assert _shm_files() == before
    assert _mapped_shm_files() == []


@contextlib.asynccontextmanager
async def _counting_peer(settings: dict[str, str], provider: str, config: dict[str, str]):
    """A comm to a peer process that counts what it reads until "end", then
    writes the count back ("hold" makes it hold its event loop for 4 s)."""
    accepted: asyncio.Queue = asyncio.Queue()
    with dask.config.set({**_config(settings), **config}):
        async with listen("lci://127.0.0.1:0", accepted.put) as listener:
            proc = subprocess.Popen(
                [sys.executable, "-c", _PEER, listener.contact_address, "counter"], env=_env(**settings)
            )
            try:
                comm = await asyncio.wait_for(accepted.get(), 30)
                assert await asyncio.wait_for(comm.read(), 30) == provider
                yield comm
                await comm.close()
            finally:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize("settings, provider", PEERS)
@gen_test(timeout=120)
async def test_a_writer_that_never_yields_loses_no_message(settings, provider):
    """Thousands of small writes in a row, the event loop never run between
    them, for longer than ofi may refuse a peer: the peer counts every one.
    (Over ofi the writer's completions went unread, libfabric answered
    "retry" to every send and the peer was lost as unreachable.)"""
    count = 40_000
    limit = {"distributed.comm.lci.ofi.unreachable-after": "0.3s"}
    async with _counting_peer(settings, provider, limit) as comm:
        start = time.monotonic()
        for i in range(count):
            await comm.write({"op": "flood", "i": i})
        writing = time.monotonic() - start
        await comm.write("end")
        assert await asyncio.wait_for(comm.read(), 60) == count
        assert writing > 0.3, f"{count} writes took {writing:.2f} s: too few to test the limit"


@pytest.mark.parametrize("settings, provider", PEERS)
@gen_test(timeout=120)
async def test_a_peer_that_holds_its_event_loop_is_not_lost(settings, provider):
    """The peer holds its event loop for 4 s, longer than ofi may refuse a
    peer it never reached, while we write to it: it counts every message
    once it reads again, as a busy peer over tcp:// does."""
    async with _counting_peer(settings, provider, {}) as comm:
        await comm.write("hold")
        sent = 0
        start = time.monotonic()
        while time.monotonic() - start < 5:
            for _ in range(100):
                await comm.write({"op": "flood", "i": sent, "pad": bytes(1000)})
                sent += 1
            await asyncio.sleep(0)
        await comm.write("end")
        assert await asyncio.wait_for(comm.read(), 60) == sent


def _payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _sizes(rng: np.random.Generator, n: int) -> list[int]:
    """Mostly small, some medium, a few up to 32 MiB; always the extremes."""
    kinds = rng.choice(3, size=n, p=[0.9, 0.09, 0.01])
    bounds = [(0, 64 * 1024), (64 * 1024, MiB), (MiB, 32 * MiB)]
    sizes = [int(rng.integers(*bounds[k], endpoint=True)) for k in kinds]
    return [0, 32 * MiB, *sizes[2:]]


@pytest.mark.parametrize("provider, reads", [
    ("shm", "1MiB"), pytest.param("shm", "0", id="shm-ring"),
    needs_ucx("ucx", "0", id="ucx"), needs_ofi("ofi", "0", id="ofi"),
])
@gen_test(timeout=600)
async def test_random_traffic_under_back_pressure_arrives_intact(provider, reads):
    """2000 messages of 0 B .. 32 MiB on 8 comms, echoed by another process,
    with rings, pools and the write high-water mark small enough that
    senders wait and large frames often find the pool full (and are read
    from the sender's memory, or go through the ring)."""
    small = {"shm__ring_size": "256KiB", "shm__pool_size": "8MiB", "shm__pool_blocks": "8",
             "shm__rendezvous_bytes": reads, "write_high_water": "4MiB", "providers": f"[{provider}]"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO], env=_env(**small), stdout=subprocess.PIPE, text=True
    )
    try:
        address = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        with dask.config.set(_config(small)):
            comms = [await connect(address.strip()) for _ in range(8)]
        assert {c.extra_info["provider"] for c in comms} == {provider}
        sizes = _sizes(np.random.default_rng(42), 2000)
        plan = [[(i, sizes[i]) for i in range(j, len(sizes), len(comms))] for j in range(len(comms))]

        async def send(comm, items):
            for i, size in items:
                await comm.write({"i": i, "payload": to_serialize(_payload(i, size))})

        async def receive(comm, items):
            for i, size in items:
                msg = await comm.read()
                assert msg["i"] == i
                expected = hashlib.blake2b(_payload(i, size).data).hexdigest()
                assert msg["hash"] == expected, f"message {i} ({size} B) corrupted on the way out"
                got = hashlib.blake2b(memoryview(msg["payload"]).cast("B")).hexdigest()
                assert got == expected, f"message {i} ({size} B) corrupted on the way back"

        await asyncio.gather(
            *(send(c, items) for c, items in zip(comms, plan, strict=True)),
            *(receive(c, items) for c, items in zip(comms, plan, strict=True)),
        )
        for comm in comms:
            await comm.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
