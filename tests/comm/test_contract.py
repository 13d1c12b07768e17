"""Contract tests of Dask's ``Comm`` / ``Listener`` API for the ``lci://`` backend.

These tests exercise the backend only through ``distributed.comm.connect`` and
``distributed.comm.listen`` (i.e. with Dask's handshake), the way the
scheduler, workers and clients use it.  They are modelled on the semantics
checked by distributed's own ``distributed/comm/tests/test_comms.py`` (the
code is our own).

Every test only listens on / contacts loopback addresses (the one exception,
``test_wildcard_listen_address_has_concrete_contact_address``, binds the
wildcard address but contacts nothing).  Every async test runs under
``distributed.utils_test.gen_test``, which runs it in a fresh event loop,
bounds it in time, and fails it if threads or open ``Comm`` objects leak.
Each blocking call is additionally bounded with ``asyncio.wait_for``.

To check the test logic against Dask's reference backend run with
``DASK_LCICOMM_CONTRACT_SCHEME=tcp``; tests of lci-only features then skip.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import gc
import inspect
import itertools
import os
import socket
import time
from contextlib import asynccontextmanager

import dask
import distributed.utils_test as _dask_utils_test
import numpy as np
import psutil
import pytest
from dask.utils import parse_bytes
from distributed.comm import (
    CommClosedError,
    connect,
    get_address_host,
    get_local_address_for,
    listen,
    parse_address,
    parse_host_port,
    resolve_address,
    unparse_host_port,
)
from distributed.comm.addressing import get_address_host_port
from distributed.comm.core import Comm, Listener
from distributed.protocol import Serialized, deserialize, serialize, to_serialize
from distributed.security import Security
from distributed.utils_test import gen_test
from ofi_support import needs_ofi
from ucx_support import needs_ucx

# Import the package before distributed.utils_test: gen_test resets Dask's
# configuration to the snapshot utils_test took when it was imported, and the
# lci defaults must be part of that snapshot (see _keep_lci_config_defaults).
import dask_lcicomm  # noqa: F401  (registers the distributed.comm.lci defaults)

# The scheme under test.  The suite must test lci; the override only exists to
# validate the test logic itself against tcp.
SCHEME = os.environ.get("DASK_LCICOMM_CONTRACT_SCHEME", "lci")
LCI_ONLY = pytest.mark.skipif(
    SCHEME != "lci", reason=f"lci-specific check (scheme under test is {SCHEME})"
)

IPV4 = "127.0.0.1"
IPV6 = "::1"

KiB = 2**10
MiB = 2**20
GiB = 2**30

# Bound of any single comm operation (read, write, close, connect, gather...).
OP_TIMEOUT = 30
# ``timeout`` passed to distributed.comm.connect for connections that must work.
CONNECT_TIMEOUT = 10
# Allowed lateness of a failing connect() beyond its own timeout.
CONNECT_SLACK = 1.0


def _keep_lci_config_defaults() -> None:
    """Make the lci defaults survive gen_test's configuration reset.

    gen_test calls ``distributed.utils_test.reset_config()``, which replaces the
    whole Dask configuration by a copy taken when ``distributed.utils_test`` was
    first imported.  If something imported utils_test before ``dask_lcicomm``
    registered its defaults, ``distributed.comm.lci.*`` would vanish inside
    every test.
    """
    lci = dask.config.get("distributed.comm.lci", default=None)
    if lci is not None:
        dask.config.update(
            _dask_utils_test.original_config,
            {"distributed": {"comm": {"lci": copy.deepcopy(lci)}}},
            priority="old",
        )


_keep_lci_config_defaults()


def _ipv6_loopback_problem() -> str | None:
    """Why IPv6 loopback cannot be used here, or None if it works."""
    if not socket.has_ipv6:
        return "Python was built without IPv6 support"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as srv:
            srv.bind((IPV6, 0))
            srv.listen(1)
            with socket.create_connection((IPV6, srv.getsockname()[1]), timeout=2):
                pass
    except OSError as e:
        return f"IPv6 loopback [::1] is not usable on this machine: {e}"
    return None


_IPV6_PROBLEM = _ipv6_loopback_problem()

HOSTS = [
    pytest.param(IPV4, id="ipv4"),
    pytest.param(
        IPV6,
        id="ipv6",
        marks=pytest.mark.skipif(_IPV6_PROBLEM is not None, reason=str(_IPV6_PROBLEM)),
    ),
]


# ---------------------------------------------------------------------------
# configuration variants
# ---------------------------------------------------------------------------


def _variant(progress: str, ndevices: int, completion: str, provider: str = "shm"):
    cfg = {"progress": progress, "ndevices": ndevices, "completion": completion,
           "providers": [provider] if provider == "tcp" else [provider, "tcp"]}
    name = f"{progress}-nd{ndevices}-{completion}-{provider}"
    needs = {"ucx": needs_ucx, "ofi": needs_ofi}.get(provider)
    return needs(cfg, id=name) if needs else pytest.param(cfg, id=name)


#: every combination of progress mode x ndevices x completion mode x provider
ALL_VARIANTS = [
    _variant(p, n, c, v)
    for p, n, c, v in itertools.product(
        ("loop", "thread", "poll"), (1, 3), ("queue", "sync"), ("shm", "tcp", "ucx", "ofi", "memory")
    )
]
#: combinations covering every pair of values of any two of the four knobs, and polling shm
PAIRWISE_VARIANTS = [
    _variant("loop", 1, "queue", "shm"),
    _variant("loop", 3, "sync", "tcp"),
    _variant("thread", 1, "sync", "tcp"),
    _variant("thread", 3, "queue", "shm"),
    _variant("poll", 1, "sync", "shm"),
    _variant("poll", 3, "queue", "tcp"),
    _variant("loop", 1, "queue", "ucx"),
    _variant("thread", 3, "sync", "ucx"),
    _variant("poll", 1, "queue", "ucx"),
    _variant("loop", 1, "sync", "ofi"),
    _variant("thread", 3, "queue", "ofi"),
    # the message device over a fabric inside the process (tests/fabric_support.py)
    _variant("loop", 3, "sync", "memory"),
    _variant("thread", 1, "queue", "memory"),
    # shm devices that poll after traffic (where a core is free; either way
    # the doorbell protocol must hold)
    pytest.param(
        {"progress": "loop", "ndevices": 1, "completion": "queue", "providers": ["shm", "tcp"],
         "shm.poll-window": "500us"},
        id="loop-nd1-queue-shm-polling",
    ),
]


def variants(params):
    """Parametrize a test over lci configuration variants (``comm_config``)."""
    return pytest.mark.parametrize("comm_config", params, indirect=True)


@pytest.fixture
def comm_config(request):
    """The ``distributed.comm.lci`` overrides of this test (keys without prefix).

    gen_test resets Dask's configuration when the test starts, so the fixture
    cannot apply the settings itself: ``contract_test`` applies them inside the
    test's event loop, around the test body.
    """
    return dict(getattr(request, "param", None) or {})


def contract_test(timeout: float = 60):
    """``gen_test`` + pytest-timeout + applying ``comm_config`` (if requested)."""

    def decorator(func):
        @functools.wraps(func)
        async def with_config(*args, **kwargs):
            overrides = kwargs.get("comm_config") or {}
            with dask.config.set(
                {f"distributed.comm.lci.{k}": v for k, v in overrides.items()}
            ):
                return await func(*args, **kwargs)

        test = gen_test(timeout=timeout)(with_config)
        return pytest.mark.timeout(timeout + 60)(test)

    return decorator


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def addr(host: str = IPV4, port: int = 0) -> str:
    return f"{SCHEME}://{unparse_host_port(host, port)}"


def host_port(address: str) -> tuple[str, int]:
    scheme, loc = parse_address(address)
    assert scheme == SCHEME, address
    return parse_host_port(loc)


def eager_threshold() -> int:
    return int(parse_bytes(dask.config.get("distributed.comm.lci.eager-threshold")))


async def bounded(aw, timeout: float = OP_TIMEOUT):
    return await asyncio.wait_for(aw, timeout)


async def stop_listener(listener) -> None:
    res = listener.stop()
    if inspect.isawaitable(res):  # tolerated here, rejected by test_many_listeners
        await res


def free_port(host: str) -> int:
    """A port nothing listens on (bound once then released)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pattern_bytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def as_bytes(x) -> bytes:
    if isinstance(x, np.ndarray):
        return x.tobytes()
    return bytes(x)


class HandlerLog:
    """Records errors raised in listener handlers (which Dask only logs)."""

    def __init__(self):
        self.errors: list[BaseException] = []
        self.started = 0
        self.finished = 0

    def wrap(self, fn):
        @functools.wraps(fn)
        async def handler(comm):
            self.started += 1
            try:
                await fn(comm)
            except BaseException as e:
                self.errors.append(e)
                raise
            finally:
                self.finished += 1

        return handler

    async def check(self, expected: int | None = None, timeout: float = OP_TIMEOUT):
        deadline = time.monotonic() + timeout
        while expected is not None and self.finished < expected:
            if self.errors:
                break
            assert time.monotonic() < deadline, (
                f"only {self.finished}/{expected} listener handlers finished"
            )
            await asyncio.sleep(0.01)
        if self.errors:
            raise AssertionError(
                f"{len(self.errors)} listener handler(s) failed"
            ) from self.errors[0]


async def echo_until_closed(comm):
    """Listener handler: echo every message until the peer goes away."""
    try:
        while True:
            msg = await comm.read()
            await comm.write(msg)
    except CommClosedError:
        pass
    finally:
        await comm.close()


@asynccontextmanager
async def comm_pair(
    host: str = IPV4,
    *,
    listen_args: dict | None = None,
    connect_args: dict | None = None,
    listener_deserialize: bool = True,
    connector_deserialize: bool = True,
):
    """Yield ``(client_comm, server_comm)`` connected through connect/listen.

    The listener handler only hands the comm over (returning from the handler
    must not close it).  Both comms are aborted and the listener stopped on
    exit.
    """
    accepted: asyncio.Queue = asyncio.Queue()

    async def hand_over(comm):
        await accepted.put(comm)

    listener = await bounded(
        listen(
            addr(host),
            hand_over,
            deserialize=listener_deserialize,
            **(listen_args or {}),
        )
    )
    client = server = None
    try:
        client = await bounded(
            connect(
                listener.contact_address,
                timeout=CONNECT_TIMEOUT,
                deserialize=connector_deserialize,
                **(connect_args or {}),
            )
        )
        server = await bounded(accepted.get())
        yield client, server
    finally:
        for comm in (client, server):
            if comm is not None:
                comm.abort()
        while not accepted.empty():
            accepted.get_nowait().abort()
        await stop_listener(listener)


async def read_n(comm, n: int) -> list:
    return [await comm.read() for _ in range(n)]


# ---------------------------------------------------------------------------
# addresses and backend helpers
# ---------------------------------------------------------------------------


def test_backend_address_functions():
    """The Backend's address helpers, used by Scheduler/Worker/Nanny."""
    assert get_address_host(f"{SCHEME}://127.0.0.1:123") == "127.0.0.1"
    assert get_address_host_port(f"{SCHEME}://127.0.0.1:123") == ("127.0.0.1", 123)
    assert resolve_address(f"{SCHEME}://127.0.0.1:123") == f"{SCHEME}://127.0.0.1:123"
    assert resolve_address(f"{SCHEME}://localhost:456") == f"{SCHEME}://127.0.0.1:456"
    assert get_local_address_for(f"{SCHEME}://127.0.0.1:80") == f"{SCHEME}://127.0.0.1"
    if _IPV6_PROBLEM is None:
        assert get_address_host(f"{SCHEME}://[::1]:123") == "::1"
        assert resolve_address(f"{SCHEME}://[::1]:123") == f"{SCHEME}://[::1]:123"
        assert get_local_address_for(f"{SCHEME}://[::1]:80") == f"{SCHEME}://[::1]"


# ---------------------------------------------------------------------------
# client / server exchange through the handshake
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
@variants(ALL_VARIANTS)
@contract_test()
async def test_client_server(host, comm_config):
    log = HandlerLog()

    async def handle(comm):
        try:
            assert isinstance(comm, Comm)
            assert comm.local_address.startswith(f"{SCHEME}://")
            assert comm.peer_address.startswith(f"{SCHEME}://")
            assert comm.remote_info["address"] == comm.peer_address
            assert comm.local_info["address"] == comm.local_address
            assert "pickle-protocol" in comm.handshake_options
            msg = await comm.read()
            assert msg["op"] == "ping"
            # a.peer_address == b.local_address and vice versa
            assert msg["client_local"] == comm.peer_address
            assert msg["client_peer"] == comm.local_address
            await comm.write(
                {
                    "op": "pong",
                    "data": msg["data"],
                    "server_local": comm.local_address,
                    "server_peer": comm.peer_address,
                }
            )
            msg = await comm.read()
            assert msg == {"op": "foobar"}
        finally:
            await comm.close()

    # arbitrary extra connection arguments must be ignored, as tcp does
    listener = await bounded(listen(addr(host), log.wrap(handle), xxx="bar"))
    try:
        assert isinstance(listener, Listener)
        lhost, lport = host_port(listener.listen_address)
        assert lhost == host
        assert lport > 0, "listen_address must carry the port actually bound"
        chost, cport = host_port(listener.contact_address)
        assert (chost, cport) == (host, lport)
        assert "0.0.0.0" not in listener.contact_address
        assert listener.contact_address == listener.listen_address

        done = []

        async def client(key, delay=0.0):
            comm = await connect(
                listener.contact_address, timeout=CONNECT_TIMEOUT, xxx="foo"
            )
            try:
                assert isinstance(comm, Comm)
                assert comm.extra_info["provider"] == comm_config["providers"][0]
                assert comm.peer_address == listener.contact_address
                assert comm.local_address.startswith(f"{SCHEME}://")
                assert get_address_host(comm.local_address) == host
                assert comm.remote_info["address"] == comm.peer_address
                assert comm.local_info["address"] == comm.local_address
                assert "pickle-protocol" in comm.handshake_options
                assert comm.same_host
                await comm.write(
                    {
                        "op": "ping",
                        "data": key,
                        "client_local": comm.local_address,
                        "client_peer": comm.peer_address,
                    }
                )
                await comm.write({"op": "foobar"})
                if delay:
                    await asyncio.sleep(delay)
                reply = await comm.read()
                assert reply["op"] == "pong"
                assert reply["data"] == key
                assert reply["server_local"] == comm.peer_address
                assert reply["server_peer"] == comm.local_address
                done.append(key)
            finally:
                await comm.close()

        await bounded(client(1234))
        # many clients at once
        await bounded(asyncio.gather(*(client(i, delay=0.05) for i in range(20))))
        assert sorted(done) == sorted([1234, *range(20)])
        await log.check(expected=21)
    finally:
        await stop_listener(listener)


@pytest.mark.parametrize("host", HOSTS)
@contract_test()
async def test_wildcard_listen_address_has_concrete_contact_address(host):
    """Listening on the wildcard address: contact_address names a real host.

    Nothing connects here (the contact address is not a loopback address).
    """
    wildcard = "0.0.0.0" if host == IPV4 else "::"

    async def handle(comm):
        await comm.close()

    listener = await bounded(listen(addr(wildcard), handle))
    try:
        _, lport = host_port(listener.listen_address)
        assert lport > 0
        chost, cport = host_port(listener.contact_address)
        assert cport == lport
        assert chost not in ("0.0.0.0", "::", "")
    finally:
        await stop_listener(listener)


@LCI_ONLY
@pytest.mark.parametrize("host", HOSTS)
@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_extra_info(host, comm_config):
    async with comm_pair(host) as (a, b):
        for comm in (a, b):
            info = comm.extra_info
            assert isinstance(info, dict)
            assert "provider" in info, info
            assert "device" in info, info


@LCI_ONLY
@pytest.mark.parametrize("ndevices", [1, 3])
@contract_test()
async def test_ndevices_spreads_comms(ndevices):
    """Comms to one peer are spread over the configured number of devices
    (checks the config variant really reaches the backend)."""
    NCOMMS = 12
    log = HandlerLog()
    with dask.config.set({"distributed.comm.lci.ndevices": ndevices}):
        async with listen(addr(), log.wrap(echo_until_closed)) as listener:
            comms = await bounded(
                asyncio.gather(
                    *(
                        connect(listener.contact_address, timeout=CONNECT_TIMEOUT)
                        for _ in range(NCOMMS)
                    )
                )
            )
            try:
                for i, comm in enumerate(comms):
                    await bounded(comm.write(i))
                    assert await bounded(comm.read()) == i
                devices = {comm.extra_info["device"] for comm in comms}
            finally:
                for comm in comms:
                    await bounded(comm.close())
            await log.check(expected=NCOMMS)
    if ndevices == 1:
        assert len(devices) == 1, devices
    else:
        assert 1 < len(devices) <= ndevices, devices


@contract_test()
async def test_default_security_connection_args():
    """Dask always passes Security's (unencrypted) connection arguments."""
    sec = Security()
    async with comm_pair(
        listen_args=sec.get_listen_args("scheduler"),
        connect_args=sec.get_connection_args("client"),
    ) as (a, b):
        await bounded(a.write("hello"))
        assert await bounded(b.read()) == "hello"
        await bounded(b.write("world"))
        assert await bounded(a.read()) == "world"


@contract_test()
async def test_require_encryption_is_refused():
    """lci is not encrypted: like tcp:// (RequireEncryptionMixin, a RuntimeError
    mentioning encryption), refuse to listen or connect when encryption is
    required, and fail at once rather than after the connect timeout."""

    async def handle(comm):
        await comm.close()

    with pytest.raises(Exception, match=r"(?i)encrypt"):
        listener = await bounded(listen(addr(), handle, require_encryption=True))
        await stop_listener(listener)  # not reached when the contract holds

    async with listen(addr(), handle) as listener:
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)encrypt"):
            comm = await bounded(
                connect(listener.contact_address, timeout=5, require_encryption=True)
            )
            comm.abort()  # not reached when the contract holds
        assert time.monotonic() - t0 < 4


@contract_test()
async def test_repr():
    async with comm_pair() as (a, b):
        assert "closed" not in repr(a)
        assert "closed" not in repr(b)
        await bounded(a.close())
        assert "closed" in repr(a)
        assert a.local_address in repr(a)
        assert a.peer_address in repr(a)
        await bounded(b.close())
        assert "closed" in repr(b)


# ---------------------------------------------------------------------------
# close / abort semantics
# ---------------------------------------------------------------------------


@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_peer_close_is_seen_as_comm_closed(comm_config):
    """Implicit close: the other side's close() makes read and write raise."""
    closed: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        await comm.close()
        assert comm.closed()
        await closed.put(comm)

    async with listen(addr(), handle) as listener:
        # a read pending or issued after the peer's close raises
        comm = await bounded(connect(listener.contact_address, timeout=CONNECT_TIMEOUT))
        try:
            with pytest.raises(CommClosedError):
                await bounded(comm.read())
            assert comm.closed()
            with pytest.raises(CommClosedError):
                await bounded(comm.write({"x": 1}))
            await bounded(closed.get())
        finally:
            comm.abort()

        # writes alone also notice it (the first one(s) may still be buffered)
        comm = await bounded(connect(listener.contact_address, timeout=CONNECT_TIMEOUT))
        try:
            await bounded(closed.get())
            with pytest.raises(CommClosedError):
                for i in range(500):  # ~5 s
                    await bounded(comm.write({"i": i}))
                    await asyncio.sleep(0.01)
            assert comm.closed()
            with pytest.raises(CommClosedError):
                await bounded(comm.read())
        finally:
            comm.abort()


@pytest.mark.parametrize("closer", ["client", "server"])
@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_explicit_close(closer, comm_config):
    """Explicit close: pending and new reads/writes on both sides raise."""
    async with comm_pair() as (client, server):
        a, b = (client, server) if closer == "client" else (server, client)
        a_read = asyncio.ensure_future(a.read())
        b_read = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.05)
        assert not a_read.done() and not b_read.done()

        await bounded(a.close())
        assert a.closed()
        # in-flight reads abort, on the closing side and on the peer
        with pytest.raises(CommClosedError):
            await bounded(a_read)
        with pytest.raises(CommClosedError):
            await bounded(b_read)
        assert b.closed()
        # and so do new reads and writes
        for comm in (a, b):
            with pytest.raises(CommClosedError):
                await bounded(comm.read())
            with pytest.raises(CommClosedError):
                await bounded(comm.write({}))
        # close() is idempotent
        await bounded(b.close())
        await bounded(a.close())
        assert a.closed() and b.closed()


@pytest.mark.parametrize("side", ["client", "server"])
@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_abort(side, comm_config):
    async with comm_pair() as (client, server):
        a, b = (client, server) if side == "client" else (server, client)
        pending = asyncio.ensure_future(a.read())
        await asyncio.sleep(0.05)

        assert a.abort() is None  # synchronous, never raises
        assert a.closed()
        assert a.abort() is None  # twice
        assert a.closed()
        with pytest.raises(CommClosedError):
            await bounded(pending)
        with pytest.raises(CommClosedError):
            await bounded(a.read())
        with pytest.raises(CommClosedError):
            await bounded(a.write("x"))
        await bounded(a.close())  # close after abort is fine

        # the peer notices
        with pytest.raises(CommClosedError):
            await bounded(b.read())
        assert b.closed()
        assert b.abort() is None
        assert b.abort() is None
        assert b.closed()

    # abort right after connecting, on both sides, twice
    async with comm_pair() as (client, server):
        for comm in (client, server, client, server):
            assert comm.abort() is None
            assert comm.closed()


@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_messages_written_before_close_are_delivered(comm_config):
    thr = eager_threshold()

    # small messages; the peer only starts reading after close() returned
    async with comm_pair() as (a, b):
        await bounded(a.write({"i": 0}))
        await bounded(a.write({"i": 1, "b": b"x" * 100}))
        await bounded(a.close())
        assert await bounded(b.read()) == {"i": 0}
        assert await bounded(b.read()) == {"i": 1, "b": b"x" * 100}
        with pytest.raises(CommClosedError):
            await bounded(b.read())

    # small and large (non-eager) messages, the peer reading concurrently
    big = np.frombuffer(pattern_bytes(1, 4 * thr + 3), dtype=np.uint8)
    async with comm_pair() as (a, b):
        reader = asyncio.ensure_future(read_n(b, 3))
        await bounded(a.write({"i": 0}))
        await bounded(a.write({"i": 1, "big": to_serialize(big)}))
        await bounded(a.write({"i": 2}))
        await bounded(a.close())
        msgs = await bounded(reader)
        assert [m["i"] for m in msgs] == [0, 1, 2]
        np.testing.assert_array_equal(msgs[1]["big"], big)
        with pytest.raises(CommClosedError):
            await bounded(b.read())


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("how", ["wait_for", "cancel"])
@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_cancelled_read_closes_comm(how, side, comm_config):
    """A read interrupted by cancellation (e.g. asyncio.wait_for's timeout)
    cannot know how much of a message was consumed: the comm is closed."""
    async with comm_pair() as (client, server):
        a, b = (client, server) if side == "client" else (server, client)
        if how == "wait_for":
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(b.read(), 0.05)
        else:
            task = asyncio.ensure_future(b.read())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert b.closed()
        with pytest.raises(CommClosedError):
            await bounded(b.read())
        with pytest.raises(CommClosedError):
            await bounded(b.write("x"))
        # the peer learns that the comm is gone
        with pytest.raises(CommClosedError):
            await bounded(a.read())


def _raise_eoferror():
    raise EOFError


class _EOFOnUnpickle:
    def __reduce__(self):
        return _raise_eoferror, ()


@contract_test()
async def test_eoferror_while_deserializing_closes_comm():
    """As tcp: an EOFError while deserializing a received message means
    garbled/truncated frames; the comm is closed and both sides see
    CommClosedError."""
    log = HandlerLog()

    async def handle(comm):
        try:
            await comm.write({"data": to_serialize(_EOFOnUnpickle())})
            with pytest.raises(CommClosedError):
                await comm.read()
        finally:
            await comm.close()

    async with listen(addr(), log.wrap(handle)) as listener:
        comm = await bounded(connect(listener.contact_address, timeout=CONNECT_TIMEOUT))
        try:
            with pytest.raises(CommClosedError):
                await bounded(comm.read())
            assert comm.closed()
        finally:
            comm.abort()
        await log.check(expected=1)


# ---------------------------------------------------------------------------
# connecting to nothing, listeners
# ---------------------------------------------------------------------------


async def _assert_connect_fails_in_time(address: str, timeout: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(OSError) as excinfo:
        comm = await asyncio.wait_for(
            connect(address, timeout=timeout), timeout + OP_TIMEOUT
        )
        comm.abort()  # not reached when the contract holds
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + CONNECT_SLACK, (
        f"connect({address!r}, timeout={timeout}) failed only after {elapsed:.2f} s"
        f" ({excinfo.value!r})"
    )


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("timeout", [0.2, 1.0])
@contract_test()
async def test_connect_to_dead_address(host, timeout):
    await _assert_connect_fails_in_time(addr(host, free_port(host)), timeout)


@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_connect_to_dead_address_variants(comm_config):
    await _assert_connect_fails_in_time(addr(IPV4, free_port(IPV4)), 0.5)


@contract_test(timeout=120)
async def test_many_listeners():
    """100 listeners in one process: distinct addresses, each reachable;
    stop() is synchronous, refuses new connections at once and leaves
    established comms working."""
    N = 100
    KEEP = (0, N // 2, N - 1)
    log = HandlerLog()
    listeners = []
    comms = []
    stopped = False
    try:
        for _ in range(N):
            listeners.append(await bounded(listen(addr(), log.wrap(echo_until_closed))))
        assert len({lst.listen_address for lst in listeners}) == N
        assert len({lst.contact_address for lst in listeners}) == N
        contacts = [lst.contact_address for lst in listeners]
        for contact in contacts:
            assert host_port(contact)[0] == IPV4

        async def ping(i):
            comm = await connect(contacts[i], timeout=CONNECT_TIMEOUT)
            await comm.write({"i": i})
            assert await comm.read() == {"i": i}
            return comm

        for start in range(0, N, 25):
            comms += await bounded(
                asyncio.gather(*(ping(i) for i in range(start, min(start + 25, N))))
            )
        assert len(comms) == N
        for i, comm in enumerate(comms):
            if i not in KEEP:
                await bounded(comm.close())

        for lst in listeners:
            res = lst.stop()
            assert not inspect.isawaitable(res), "Listener.stop() must be synchronous"
        stopped = True

        # no await between stop() and here: new connections must fail at once
        timeout = 1.0
        t0 = time.monotonic()
        results = await bounded(
            asyncio.gather(
                *(connect(contact, timeout=timeout) for contact in contacts),
                return_exceptions=True,
            )
        )
        elapsed = time.monotonic() - t0
        unexpected = [r for r in results if not isinstance(r, OSError)]
        for r in unexpected:
            if isinstance(r, Comm):
                r.abort()
        assert not unexpected, unexpected[:3]
        assert elapsed < timeout + CONNECT_SLACK + 1.0, elapsed

        # established comms keep working
        for i in KEEP:
            await bounded(comms[i].write({"after-stop": i}))
            assert await bounded(comms[i].read()) == {"after-stop": i}
    finally:
        for comm in comms:
            comm.abort()
        if not stopped:
            for lst in listeners:
                await stop_listener(lst)
    await log.check(expected=N)


@contract_test()
async def test_listener_port_reusable_after_stop():
    async def new_listener(comm):
        try:
            msg = await comm.read()
            await comm.write({"who": "new", "got": msg})
        finally:
            await comm.close()

    listener = await bounded(listen(addr(), echo_until_closed))
    port = host_port(listener.listen_address)[1]
    old = await bounded(connect(listener.contact_address, timeout=CONNECT_TIMEOUT))
    try:
        listener.stop()
        listener2 = await bounded(listen(addr(IPV4, port), new_listener))
        try:
            assert host_port(listener2.listen_address)[1] == port
            comm = await bounded(connect(listener2.contact_address, timeout=CONNECT_TIMEOUT))
            try:
                await bounded(comm.write("hi"))
                assert await bounded(comm.read()) == {"who": "new", "got": "hi"}
            finally:
                comm.abort()
            await bounded(old.write("still there"))
            assert await bounded(old.read()) == "still there"
        finally:
            await stop_listener(listener2)
    finally:
        old.abort()


# ---------------------------------------------------------------------------
# deserialize=False
# ---------------------------------------------------------------------------


def _message(kind: str):
    """(message, expected values) for the deserialize tests."""
    if kind == "small":
        ser_value, to_ser_value, x = 456, 123, b"abc"
    else:  # large enough to travel as separate, non-eager payload
        x = pattern_bytes(2, 4 * MiB)
        ser_value = to_ser_value = x
    msg = {
        "op": "update",
        "x": x,
        "to_ser": [to_serialize(to_ser_value)],
        "ser": Serialized(*serialize(ser_value)),
    }
    return msg, {"x": x, "to_ser": to_ser_value, "ser": ser_value}


def _check_received(out, expected, deserialized: bool) -> None:
    assert sorted(out) == ["op", "ser", "to_ser", "x"]
    assert out["op"] == "update"
    assert out["x"] == expected["x"]
    to_ser = out["to_ser"]
    assert isinstance(to_ser, (list, tuple)) and len(to_ser) == 1
    (to_ser,) = to_ser
    ser = out["ser"]
    if deserialized:
        assert to_ser == expected["to_ser"]
        assert ser == expected["ser"]
    else:
        # over a network comm, to_serialize(obj) arrives serialized
        assert isinstance(to_ser, Serialized), type(to_ser)
        assert deserialize(to_ser.header, to_ser.frames) == expected["to_ser"]
        assert isinstance(ser, Serialized), type(ser)
        assert deserialize(ser.header, ser.frames) == expected["ser"]


@pytest.mark.parametrize("kind", ["small", "large"])
@pytest.mark.parametrize("flag", [False, True], ids=["deserialize=False", "deserialize=True"])
@pytest.mark.parametrize("side", ["listener", "connector"])
@contract_test()
async def test_deserialize_flag(side, flag, kind):
    msg, expected = _message(kind)
    kwargs = {f"{'listener' if side == 'listener' else 'connector'}_deserialize": flag}
    async with comm_pair(**kwargs) as (client, server):
        sender, receiver = (client, server) if side == "listener" else (server, client)
        await bounded(sender.write(msg))
        out = await bounded(receiver.read())
    _check_received(out, expected, deserialized=flag)


@pytest.mark.parametrize("flag", [False, True], ids=["deserialize=False", "deserialize=True"])
@contract_test()
async def test_deserialize_roundtrip(flag):
    """A message read with deserialize=False can be written back as is."""
    msg, expected = _message("large")
    async with comm_pair(listener_deserialize=flag, connector_deserialize=flag) as (a, b):
        await bounded(a.write(msg))
        got = await bounded(b.read())
        await bounded(b.write(got))
        back = await bounded(a.read())
    assert sorted(back) == sorted(msg)
    assert back["op"] == msg["op"] and back["x"] == msg["x"]
    if flag:
        assert isinstance(back["to_ser"][0], (bytes, bytearray))
        assert isinstance(back["ser"], (bytes, bytearray))
        assert back["to_ser"][0] == expected["to_ser"] and back["ser"] == expected["ser"]
    else:
        assert isinstance(back["to_ser"][0], (to_serialize, Serialized))
        assert isinstance(back["ser"], Serialized)
        assert deserialize(back["ser"].header, back["ser"].frames) == expected["ser"]


@variants(PAIRWISE_VARIANTS)
@contract_test()
async def test_forward_serialized_through_another_comm(comm_config):
    """A -> B (deserialize=False) -> C (deserialize=True): B forwards the
    still-serialized payload untouched over a second comm, C gets the object."""
    thr = eager_threshold()
    big = np.frombuffer(pattern_bytes(3, 3 * thr + 7), dtype=np.uint8)
    obj = {"small": np.arange(10), "set": {1, 2, 3}, "big": big}
    async with comm_pair(listener_deserialize=False) as (a, b), comm_pair(
        listener_deserialize=True
    ) as (b2, c):
        await bounded(a.write({"op": "fwd", "payload": to_serialize(obj), "tag": "t"}))
        got = await bounded(b.read())
        assert isinstance(got["payload"], Serialized)
        await bounded(b2.write(got))
        final = await bounded(c.read())
    assert final["op"] == "fwd" and final["tag"] == "t"
    out = final["payload"]
    np.testing.assert_array_equal(out["small"], obj["small"])
    assert out["set"] == {1, 2, 3}
    np.testing.assert_array_equal(out["big"], big)


# ---------------------------------------------------------------------------
# payload sizes
# ---------------------------------------------------------------------------

SIZE_CASES = ["0B", "eager-1", "eager", "eager+1", "64MiB"]


def _size(case: str) -> int:
    thr = eager_threshold()
    return {
        "0B": 0,
        "eager-1": thr - 1,
        "eager": thr,
        "eager+1": thr + 1,
        "64MiB": 64 * MiB,
    }[case]


def _check_payload(msg, n, arr, blob) -> None:
    assert msg["op"] == "data" and msg["n"] == n
    got = msg["arr"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.uint8 and got.shape == (n,)
    assert np.array_equal(got, arr)
    assert as_bytes(msg["blob"]) == blob
    assert isinstance(msg["inline"], bytes) and msg["inline"] == blob


@pytest.mark.parametrize("size", SIZE_CASES)
@variants(ALL_VARIANTS)
@contract_test(timeout=120)
async def test_payload_sizes(size, comm_config):
    """Frames of 0 B, around the eager threshold and 64 MiB arrive byte-exact,
    in both directions.  Compression is off so the data frames have exactly
    the sizes named."""
    n = _size(size)
    arr = np.frombuffer(pattern_bytes(10, n), dtype=np.uint8)
    blob = pattern_bytes(11, n)
    with dask.config.set({"distributed.comm.compression": None}):
        async with comm_pair() as (a, b):
            nbytes = await bounded(
                a.write(
                    {
                        "op": "data",
                        "n": n,
                        "arr": to_serialize(arr),  # a frame of exactly n bytes
                        "blob": to_serialize(blob),  # another one
                        "inline": blob,  # inside the msgpack frame
                    }
                )
            )
            # BatchedSend relies on write() returning the number of bytes sent
            assert isinstance(nbytes, int) and nbytes >= 2 * n
            got = await bounded(b.read())
            _check_payload(got, n, arr, blob)

            # echo back what was received
            await bounded(
                b.write(
                    {
                        "op": "data",
                        "n": n,
                        "arr": to_serialize(got["arr"]),
                        "blob": to_serialize(as_bytes(got["blob"])),
                        "inline": got["inline"],
                    }
                )
            )
            _check_payload(await bounded(a.read()), n, arr, blob)

            # a bare bytes message
            await bounded(a.write(blob))
            raw = await bounded(b.read())
            assert as_bytes(raw) == blob


@variants(PAIRWISE_VARIANTS)
@contract_test(timeout=120)
async def test_mixed_frame_sizes_in_one_message(comm_config):
    thr = eager_threshold()
    sizes = [0, 1, thr - 1, thr, thr + 1, 0, 3 * thr + 5, 2 * MiB + 3, 7]
    arrays = [
        np.frombuffer(pattern_bytes(100 + i, n), dtype=np.uint8)
        for i, n in enumerate(sizes)
    ]
    with dask.config.set({"distributed.comm.compression": None}):
        async with comm_pair() as (a, b):
            await bounded(a.write({"arrays": [to_serialize(x) for x in arrays]}))
            got = await bounded(b.read())
            assert len(got["arrays"]) == len(arrays)
            for x, y in zip(arrays, got["arrays"], strict=True):
                assert y.shape == x.shape and np.array_equal(x, y)


_BIG_N = 2**31 + 17
_PERIOD = 1_048_583  # prime: a shift by any power of two cannot go unnoticed
_BIG_PART = 64 * MiB
_BIG_MEM_NEEDED = 8 * GiB


def _big_pattern_checks(parts: list, block: np.ndarray) -> None:
    """Check received ``parts`` (consecutive pieces of ``np.resize(block,
    _BIG_N)``) by their sum and by sampled slices, without concatenating."""
    n, period, width = _BIG_N, block.size, 4096
    assert all(isinstance(p, np.ndarray) and p.dtype == np.uint8 for p in parts)
    assert sum(p.size for p in parts) == n
    expected_sum = int(block.sum(dtype=np.uint64)) * (n // period) + int(
        block[: n % period].sum(dtype=np.uint64)
    )
    assert sum(int(p.sum(dtype=np.uint64)) for p in parts) == expected_sum
    offsets = {0, period - 100, 2**31 - width, 2**31 - width // 2, 2**31, n - width}
    offsets |= {k * MiB - width // 2 for k in (1, 2, 64, 65, 1024, 2047, 2048)}
    offsets |= {int(o) for o in np.random.default_rng(5).integers(0, n - width, 64)}
    start = 0
    for part in parts:
        stop = start + part.size
        for off in sorted(offsets):
            lo, hi = max(off, start), min(off + width, stop)
            if lo >= hi:
                continue
            idx = np.arange(lo, hi, dtype=np.int64) % period
            np.testing.assert_array_equal(
                part[lo - start : hi - start], block[idx], err_msg=f"at byte {lo}"
            )
        start = stop


@pytest.mark.bigmem
@pytest.mark.skipif(
    psutil.virtual_memory().available < _BIG_MEM_NEEDED,
    reason=f"needs {_BIG_MEM_NEEDED // GiB} GiB of available memory",
)
@pytest.mark.parametrize("framing", ["single-frame", "many-frames"])
@contract_test(timeout=300)
async def test_message_over_2gib(framing):
    """A message of 2 GiB + 17 B (peak ~4.5 GiB RSS: sender + receiver copy).

    single-frame: one array, Dask's sharding disabled, so one frame > 2**31 B;
    many-frames: 33 arrays (views of one buffer), >= 33 frames, > 2**31 B total.
    """
    block = np.random.default_rng(4).integers(0, 256, _PERIOD, dtype=np.uint8)
    arr = np.resize(block, _BIG_N)
    if framing == "single-frame":
        payload = to_serialize(arr)
    else:
        payload = [
            to_serialize(arr[i : i + _BIG_PART]) for i in range(0, _BIG_N, _BIG_PART)
        ]
    shard = "8GiB" if framing == "single-frame" else dask.config.get("distributed.comm.shard")
    with dask.config.set(
        {"distributed.comm.compression": None, "distributed.comm.shard": shard}
    ):
        async with comm_pair() as (a, b):
            if framing == "single-frame":
                a.max_shard_size = 8 * GiB  # tcp reads it from the comm object
            reader = asyncio.ensure_future(b.read())
            nbytes = await bounded(a.write({"payload": payload}), 240)
            del arr, payload
            assert nbytes >= _BIG_N
            msg = await bounded(reader, 240)
            got = msg.pop("payload")
            del msg
            parts = [got] if framing == "single-frame" else list(got)
            del got
            try:
                _big_pattern_checks(parts, block)
            finally:
                del parts
                gc.collect()


# ---------------------------------------------------------------------------
# many comms, many messages
# ---------------------------------------------------------------------------


@variants(PAIRWISE_VARIANTS)
@contract_test(timeout=180)
async def test_many_concurrent_comms_route_messages(comm_config):
    """200 comms between the same two endpoints, all busy at once: every comm
    gets back exactly its own messages, in order."""
    NCOMMS, NMSGS = 200, 10
    thr = eager_threshold()
    sizes = [16, thr - 1, thr + 1, 100, 2 * thr + 3]
    log = HandlerLog()

    def payload(cid: int, seq: int) -> bytes:
        return pattern_bytes(cid * 1000 + seq, sizes[(cid + seq) % len(sizes)])

    async def echo_checking(comm):
        cid = None
        seq = 0
        try:
            while True:
                msg = await comm.read()
                if cid is None:
                    cid = msg["cid"]
                assert (msg["cid"], msg["seq"]) == (cid, seq), "misrouted on server"
                seq += 1
                await comm.write({**msg, "server_peer": comm.peer_address})
        except CommClosedError:
            assert seq == NMSGS, f"comm {cid}: {seq}/{NMSGS} messages"
        finally:
            await comm.close()

    async with listen(addr(), log.wrap(echo_checking)) as listener:
        comms = []
        try:
            for start in range(0, NCOMMS, 50):
                comms += await bounded(
                    asyncio.gather(
                        *(
                            connect(listener.contact_address, timeout=CONNECT_TIMEOUT)
                            for _ in range(start, min(start + 50, NCOMMS))
                        )
                    )
                )

            async def run(cid, comm):
                async def writer():
                    for seq in range(NMSGS):
                        await comm.write(
                            {"cid": cid, "seq": seq, "data": to_serialize(payload(cid, seq))}
                        )

                async def reader():
                    for seq in range(NMSGS):
                        msg = await comm.read()
                        assert (msg["cid"], msg["seq"]) == (cid, seq), "misrouted"
                        assert as_bytes(msg["data"]) == payload(cid, seq)
                        assert msg["server_peer"] == comm.local_address

                await asyncio.gather(writer(), reader())

            await bounded(
                asyncio.gather(*(run(cid, comm) for cid, comm in enumerate(comms))), 120
            )
        finally:
            for comm in comms:
                await bounded(comm.close())
        await log.check(expected=NCOMMS)


@variants(ALL_VARIANTS)
@contract_test(timeout=120)
async def test_1000_messages_in_flight_in_order(comm_config):
    """1000 small messages written before the peer reads any of them arrive,
    in order, in both directions."""
    N = 1000
    async with comm_pair() as (a, b):
        for src, dst in ((a, b), (b, a)):
            for i in range(N):
                try:
                    await asyncio.wait_for(src.write({"i": i, "pad": b"x" * (i % 97)}), 10)
                except asyncio.TimeoutError:
                    pytest.fail(f"write #{i} blocked while the peer was not reading")
            for i in range(N):
                msg = await bounded(dst.read())
                assert msg == {"i": i, "pad": b"x" * (i % 97)}


@variants(PAIRWISE_VARIANTS)
@contract_test(timeout=120)
async def test_mixed_sizes_in_order_with_concurrent_reader(comm_config):
    thr = eager_threshold()
    sizes = [0, 1, thr - 1, thr, thr + 1, 4 * thr + 3, MiB + 5, 10]
    N = 240

    def message(i):
        return {"i": i, "data": to_serialize(pattern_bytes(i, sizes[i % len(sizes)]))}

    async with comm_pair() as (a, b):

        async def writer():
            for i in range(N):
                await a.write(message(i))

        async def reader():
            for i in range(N):
                msg = await b.read()
                assert msg["i"] == i
                assert as_bytes(msg["data"]) == pattern_bytes(i, sizes[i % len(sizes)])

        await bounded(asyncio.gather(writer(), reader()), 90)


@variants(PAIRWISE_VARIANTS)
@contract_test(timeout=120)
async def test_both_sides_write_before_reading(comm_config):
    """Both peers write 2 x 24 MiB (less than the default write-high-water)
    before either reads: writes must not wait for the peer's read()."""
    blobs = [pattern_bytes(20 + i, 24 * MiB) for i in range(4)]
    async with comm_pair() as (a, b):

        async def write_two(comm, first):
            for k in (first, first + 1):
                await comm.write({"k": k, "data": to_serialize(blobs[k])})

        await bounded(asyncio.gather(write_two(a, 0), write_two(b, 2)))
        for comm, first in ((b, 0), (a, 2)):
            for k in (first, first + 1):
                msg = await bounded(comm.read())
                assert msg["k"] == k and as_bytes(msg["data"]) == blobs[k]
