"""distributed's scheme-generic comm checks, run over the default scheme.

``distributed/comm/tests/test_comms.py`` writes its comm contract once, as
``check_*`` helpers that take an address, and calls them from one test per
scheme it knows (tcp, tls, inproc). This module calls the same helpers,
imported unchanged, with addresses of Dask's default scheme, so that one test
id runs over ``lci://`` in one run and over ``tcp://`` in the baseline run and
the two results can be compared. Each test mirrors the upstream ``test_tcp_*``
test of the same suffix; tests that are about TCP itself (tornado streams,
TLS certificates, the TCP connector class) are not mirrored.

Not collected by the project's own pytest (the name does not match
``test_*.py``); ``python -m tests.upstream`` passes it to pytest explicitly.
"""

from __future__ import annotations

from typing import Any

import dask
import pytest
from distributed.comm import connect, listen
from distributed.comm.tests.test_comms import (
    EXTERNAL_IP4,
    OpaqueList,
    check_addresses,
    check_client_server,
    check_comm_closed_explicit,
    check_comm_closed_implicit,
    check_connect_timeout,
    check_deserialize,
    check_deserialize_eoferror,
    check_deserialize_roundtrip,
    check_many_listeners,
    check_repr,
    get_comm_pair,
    tcp_eq,
)
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test, requires_ipv6


def addr(loc: str = "") -> str:
    """``loc`` over the default scheme (which the runner sets per run)."""
    return f"{dask.config.get('distributed.comm.default-scheme')}://{loc}"


@gen_test()
async def test_client_server_ipv4() -> None:
    await check_client_server(addr("127.0.0.1"), tcp_eq("127.0.0.1"))
    await check_client_server(addr("127.0.0.1:3221"), tcp_eq("127.0.0.1", 3221))
    await check_client_server(addr("0.0.0.0"), tcp_eq("0.0.0.0"), tcp_eq(EXTERNAL_IP4))
    await check_client_server(addr("0.0.0.0:3222"), tcp_eq("0.0.0.0", 3222), tcp_eq(EXTERNAL_IP4, 3222))
    await check_client_server(addr(), tcp_eq("0.0.0.0"), tcp_eq(EXTERNAL_IP4))
    await check_client_server(addr(":3223"), tcp_eq("0.0.0.0", 3223), tcp_eq(EXTERNAL_IP4, 3223))


@requires_ipv6
@gen_test()
async def test_client_server_ipv6() -> None:
    # Upstream's wildcard lines ("[::]") are left out: over tcp they reach
    # get_ipv6(), whose deprecation warning the suite's filterwarnings makes an error.
    await check_client_server(addr("[::1]"), tcp_eq("::1"))
    await check_client_server(addr("[::1]:3231"), tcp_eq("::1", 3231))


@gen_test()
async def test_comm_closed_implicit() -> None:
    await check_comm_closed_implicit(addr("127.0.0.1"))


@gen_test()
async def test_comm_closed_explicit() -> None:
    await check_comm_closed_explicit(addr("127.0.0.1"))


@gen_test()
async def test_connect_timeout() -> None:
    await check_connect_timeout(addr("127.0.0.1:44444"))


@gen_test()
async def test_many_listeners() -> None:
    await check_many_listeners(addr("127.0.0.1"))
    await check_many_listeners(addr("0.0.0.0"))
    await check_many_listeners(addr())


@gen_test()
async def test_deserialize() -> None:
    await check_deserialize(addr())


@gen_test()
async def test_deserialize_roundtrip() -> None:
    await check_deserialize_roundtrip(addr())


@gen_test()
async def test_deserialize_eoferror() -> None:
    await check_deserialize_eoferror(addr())


@gen_test()
async def test_repr() -> None:
    a, b = await get_comm_pair(addr("127.0.0.1"))
    assert a.local_address in repr(b)
    assert b.local_address in repr(a)
    await check_repr(a, b)


@gen_test()
async def test_addresses() -> None:
    a, b = await get_comm_pair(addr("127.0.0.1"))
    await check_addresses(a, b)


def buffer_owner(a: Any) -> Any:
    """The object that owns ``a``'s memory: upstream's
    ``distributed.protocol.utils_test.get_host_array()``, except that an owner
    of a type it does not know (such as a shared-memory lease) ends the walk
    instead of raising TypeError."""
    import numpy

    assert isinstance(a, numpy.ndarray)
    o = a
    while True:
        if isinstance(o, memoryview):
            o = o.obj
        elif isinstance(o, numpy.ndarray) and o.base is not None:
            o = o.base
        else:
            return o


@pytest.mark.parametrize("list_cls", [list, OpaqueList])
@gen_test()
async def test_do_not_share_buffers(list_cls: type) -> None:
    """Upstream's test_do_not_share_buffers, with the listener made by
    ``listen()`` rather than ``tcp.TCPListener`` and ``buffer_owner()`` for
    ``get_host_array()``: two arrays of one message must not keep one receive
    buffer alive together."""
    np = pytest.importorskip("numpy")

    async def handle_comm(comm: Any) -> None:
        msg = await comm.read()
        msg["data"] = to_serialize(list_cls([np.array([1, 2]), np.array([3, 4])]))
        await comm.write(msg)
        await comm.close()

    async with listen(addr("127.0.0.1"), handle_comm) as listener:
        comm = await connect(listener.contact_address)
        await comm.write({"op": "ping"})
        msg = await comm.read()
        await comm.close()

    a, b = msg["data"]
    assert buffer_owner(a) is not buffer_owner(b)
