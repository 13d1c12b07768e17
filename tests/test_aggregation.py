"""Aggregation: the parcels written in one event-loop iteration leave together."""

from __future__ import annotations

import asyncio

import dask
import pytest
from distributed.comm import connect, listen
from distributed.utils_test import gen_test

from dask_lcicomm.providers.message_device import MessageDevice
from dask_lcicomm.providers.message_outbox import Outbox
from dask_lcicomm.providers.message_tags import STREAM


async def _count_sends(aggregation: bool, nmessages: int, provider: str) -> int:
    """How many times the device hands the fabric stream bytes: a stream
    message of a message device, else a transmission."""
    sends = 0

    def counting_transmit(self, buffers):
        nonlocal sends
        sends += 1
        return send(self, buffers)

    def counting_post(self, message, kind, *rest):
        nonlocal sends
        sends += kind == STREAM
        return send(self, message, kind, *rest)

    received: asyncio.Queue = asyncio.Queue()

    async def sink(comm):
        for _ in range(nmessages):
            await received.put(await comm.read())
        await comm.close()

    config = {"distributed.comm.lci.aggregation": aggregation, "distributed.comm.lci.providers": [provider]}
    if provider == "shm":
        config["distributed.comm.lci.providers"] = ["shm", "tcp"]
    with dask.config.set(config):
        async with listen("lci://127.0.0.1:0", sink) as listener:
            comm = await connect(listener.contact_address)
            assert comm.extra_info["provider"] == provider
            device_class = type(comm._vconn._link.device)
            if issubclass(device_class, MessageDevice):
                sender, name, counting = Outbox, "post", counting_post
            else:
                sender, name, counting = device_class, "_transmit", counting_transmit
            send = getattr(sender, name)
            setattr(sender, name, counting)
            try:
                for i in range(nmessages):
                    await comm.write(i)
                await asyncio.sleep(0)
                got = [await asyncio.wait_for(received.get(), 10) for _ in range(nmessages)]
            finally:
                setattr(sender, name, send)
            await comm.close()
    assert got == list(range(nmessages))
    return sends


@pytest.mark.parametrize("provider", ["tcp", "shm"])
@pytest.mark.parametrize("aggregation", [True, False])
@gen_test(timeout=60)
async def test_writes_in_one_iteration_leave_together_with_aggregation(aggregation, provider):
    n = 100
    sends = await _count_sends(aggregation, n, provider)
    if aggregation:
        assert 1 <= sends <= 5, f"{sends} sends for {n} messages written in one iteration"
    else:
        assert sends >= n
