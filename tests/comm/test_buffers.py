"""Which received objects share memory: Dask's rule, over every provider.

Two objects of one message never share a buffer after receipt, so that
releasing one frees its memory; a small header may share the buffer of the
first object where tcp:// lets it (the cases of distributed's
``test_share_buffer_with_header``), as long as that object is small enough to
travel eager: a larger one gets a buffer, or a shared-memory pool block, of
exactly its own size. Dask's own helper for this,
``protocol.utils_test.get_host_array``, knows only numpy and bytes owners;
:func:`host_buffer` also sees through the shared-memory leases of the shm
provider, whose frames lie in the memory the sender wrote them to.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest
from distributed.comm import connect, listen
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test
from ofi_support import needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm.comm.comm import LCIComm
from dask_lcicomm.providers._atomics import Lease

PROVIDERS = [
    pytest.param(["shm", "tcp"], id="shm"),
    pytest.param(["tcp"], id="tcp"),
    needs_ucx(["ucx", "tcp"], id="ucx"),
    needs_ofi(["ofi", "tcp"], id="ofi"),
    # a message fabric inside the process (tests/fabric_support.py)
    pytest.param(["memory"], id="memory"),
]


def host_buffer(a: np.ndarray) -> object:
    """The object that owns ``a``'s memory: a numpy array, bytes, bytearray
    or a shared-memory lease."""
    o: object = a
    while True:
        if isinstance(o, memoryview):
            o = o.obj
        elif isinstance(o, np.ndarray) and o.base is not None:
            o = o.base
        else:
            return o


def test_host_buffer_sees_through_views():
    owner = np.arange(10)
    assert host_buffer(owner[2:5]) is owner
    data = bytearray(8)
    assert host_buffer(np.frombuffer(memoryview(data), np.uint8)) is data


class OpaqueList(list):
    """Pickled as a whole: its arrays travel as out-of-band pickle buffers."""


async def _round_trip(providers, reply, shard: int | None = None):
    """Send a ping, get ``reply()`` back from the server."""

    async def handle(comm):
        if shard is not None:
            comm.max_shard_size = shard
        msg = await comm.read()
        msg.update(reply())
        await comm.write(msg)
        await comm.close()

    with dask.config.set({"distributed.comm.lci.providers": providers}):
        async with listen("lci://127.0.0.1:0", handle) as listener:
            comm = await connect(listener.contact_address)
            try:
                assert isinstance(comm, LCIComm)
                assert comm.extra_info["provider"] == providers[0]
                await comm.write({"op": "ping"})
                return await comm.read()
            finally:
                await comm.close()


@pytest.mark.parametrize("size", [2, 100_000, 3 << 20])
@pytest.mark.parametrize("list_cls", [list, OpaqueList])
@pytest.mark.parametrize("providers", PROVIDERS)
@gen_test(timeout=30)
async def test_two_objects_of_one_message_do_not_share_a_buffer(providers, list_cls, size):
    msg = await _round_trip(
        providers,
        lambda: {"data": to_serialize(list_cls([np.full(size, 1), np.full(size, 2)]))},
    )
    a, b = msg["data"]
    assert (a == 1).all() and (b == 2).all()
    assert host_buffer(a) is not host_buffer(b)


@pytest.mark.parametrize(
    ("nbytes_np", "nbytes_other", "expect_separate_buffer"),
    [
        (1, 0, False),  # < 2 KiB of header
        (1, 1800, False),
        (1, 2100, True),  # > 2 KiB
        (60_000, 2500, False),  # < 5% of the array (with msgpack overhead)
        (60_000, 3100, True),  # > 5% of the array
        # Unlike tcp://, an array above the eager threshold (64 KiB) always
        # has a buffer (or pool block) of exactly its size, sharded or not:
        (200_000, 9500, True),
        (350_000, 0, True),
    ],
)
@pytest.mark.parametrize("providers", PROVIDERS)
@gen_test(timeout=30)
async def test_a_small_header_shares_the_first_array_buffer_where_tcp_would(
    providers, nbytes_np, nbytes_other, expect_separate_buffer
):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, nbytes_np, dtype="u1")
    other = rng.bytes(nbytes_other)
    msg = await _round_trip(
        providers, lambda: {"np": to_serialize(array), "other": other}, shard=250_000
    )
    a = msg["np"]
    assert np.array_equal(a, array) and msg["other"] == other
    owner = host_buffer(a)
    assert (memoryview(owner).nbytes == a.nbytes) == expect_separate_buffer


@pytest.mark.parametrize("providers", [p for p in PROVIDERS if p.id != "shm"])
@gen_test(timeout=30)
async def test_a_large_frame_lands_in_the_memory_a_freed_one_left(providers):
    """Over a message fabric, a received bulk group is a frame-memory region
    (:mod:`dask_lcicomm.providers.frame_memory`): once Dask frees the frame,
    the next frame of its size class is received into the same memory."""
    array = np.arange(3 << 20, dtype="u1")

    async def handle(comm):
        for _ in range(2):
            await comm.read()
            await comm.write({"x": to_serialize(array)})
        await comm.close()

    with dask.config.set({"distributed.comm.lci.providers": providers}):
        async with listen("lci://127.0.0.1:0", handle) as listener:
            comm = await connect(listener.contact_address)
            try:
                addresses = []
                for _ in range(2):
                    await comm.write({"op": "ping"})
                    x = (await comm.read())["x"]
                    assert np.array_equal(x, array)
                    assert isinstance(host_buffer(x), Lease)
                    addresses.append(x.ctypes.data)
                    del x
                assert addresses[0] == addresses[1]
            finally:
                await comm.close()
