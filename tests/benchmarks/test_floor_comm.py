"""floor://, the benchmarks' reference comm: it must be a working Dask comm,
or the floor it measures means nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from distributed.comm import connect, listen
from distributed.comm.core import CommClosedError
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test

from benchmarks._comm_peers import BenchSpec
from benchmarks._contenders import Configuration
from benchmarks._floor_comm import SCHEME
from benchmarks.comm import IDLE, run_idle


async def _echo(comm):
    try:
        while True:
            msg = await comm.read()
            await comm.write({"op": "pong", "x": to_serialize(msg["x"])})
    except CommClosedError:
        pass


@pytest.mark.parametrize("nbytes", [0, 8, 1 << 20])
@gen_test(timeout=30)
async def test_round_trip(nbytes):
    async with listen(f"{SCHEME}://127.0.0.1:0", _echo) as listener:
        comm = await connect(listener.contact_address)
        x = np.arange(nbytes, dtype="u1")
        await comm.write({"op": "ping", "x": to_serialize(x)})
        reply = await comm.read()
        assert reply["op"] == "pong"
        np.testing.assert_array_equal(reply["x"], x)
        assert comm.peer_address == listener.contact_address
        await comm.close()
        assert comm.closed()


@gen_test(timeout=30)
async def test_a_peer_that_closes_ends_reads_with_comm_closed():
    accepted: asyncio.Queue = asyncio.Queue()
    async with listen(f"{SCHEME}://127.0.0.1:0", accepted.put) as listener:
        comm = await connect(listener.contact_address)
        server_side = await accepted.get()
        await server_side.close()
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()


def test_no_idle_cluster_is_started_on_floor():
    """floor:// registers in the benchmark processes only: a cluster's
    workers could not speak it, so the idle benchmark says why it has no
    number instead of failing to start one."""
    spec = BenchSpec("idle", IDLE, 0, duration_s=1.0, max_count=1, warmup=0, timeout_s=30.0)
    outcome = run_idle(spec, Configuration.of_scheme(SCHEME), 0)
    assert outcome.values is None
    assert "no cluster runs on it" in (outcome.error or "")
