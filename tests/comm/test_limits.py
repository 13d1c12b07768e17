"""Limits travel in the greeting: a sender stays within what its receiver
accepts, whatever its own configuration says."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test

ECHO_SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from distributed.comm import listen
    from distributed.comm.core import CommClosedError

    async def echo(comm):
        try:
            while True:
                await comm.write(await comm.read())
        except CommClosedError:
            pass

    async def main():
        async with listen("lci://127.0.0.1:0", echo) as listener:
            print(listener.contact_address, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())
    """
)


@pytest.fixture
def echo_server_with_small_limits():
    """An echo server in its own process that accepts 1 MiB of eager data
    and 70,000 frames per message; yields its address."""
    env = dict(
        os.environ,
        DASK_DISTRIBUTED__COMM__LCI__MAX_EAGER_BYTES="1MiB",
        DASK_DISTRIBUTED__COMM__LCI__MAX_FRAMES="70000",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("lci://"), address
        yield address
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("providers", [["shm", "tcp"], ["tcp"]], ids=["shm", "tcp"])
@gen_test(timeout=120)
async def test_a_sender_respects_the_receivers_eager_limit(echo_server_with_small_limits, providers):
    """30,000 small frames are about 2 MiB inline: over the receiver's 1 MiB,
    well under our 64 MiB. The sender moves what does not fit out of line."""
    import dask

    with dask.config.set({"distributed.comm.lci.providers": providers}):
        comm = await connect(echo_server_with_small_limits)
        other = await connect(echo_server_with_small_limits)
        try:
            arrays = [np.full(8, i) for i in range(30_000)]
            await comm.write({"x": [to_serialize(a) for a in arrays]})
            echoed = await asyncio.wait_for(comm.read(), 60)
            assert len(echoed["x"]) == 30_000
            assert all(int(a[0]) == i for i, a in enumerate(echoed["x"]))
            await other.write("still here")
            assert await other.read() == "still here"
        finally:
            await comm.close()
            await other.close()


@gen_test(timeout=60)
async def test_a_message_over_the_receivers_frame_limit_fails_that_comm_only(
    echo_server_with_small_limits,
):
    comm = await connect(echo_server_with_small_limits)
    other = await connect(echo_server_with_small_limits)
    try:
        with pytest.raises(ValueError, match="exceeds the peer's limits"):
            await comm.write({"x": [to_serialize(np.zeros(1)) for _ in range(40_000)]})
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await comm.read()
        await other.write("unaffected")
        assert await other.read() == "unaffected"
    finally:
        await other.close()
