"""The benchmark's server and client processes: only ``distributed.comm``'s public API, so the
same code measures every scheme, with messages shaped as Dask's own task messages."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from time import perf_counter
from typing import Any

import numpy as np
from distributed.comm import connect, listen
from distributed.comm.core import CommClosedError
from distributed.protocol import to_serialize

from benchmarks import _floor_comm  # noqa: F401  (registers floor://)

SERIALIZERS = ("dask", "pickle")

#: Seconds allowed for establishing one comm (connect + Dask handshake).
CONNECT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark: loops stop at ``max_count`` or after ``duration_s`` (a slow backend yields
    a small sample, not a hang); ``timeout_s`` bounds all of it.  ``idle`` runs in the parent."""

    name: str
    kind: str  # key of KERNELS, or "idle"
    payload_bytes: int
    duration_s: float
    max_count: int  # per comm
    warmup: int  # untimed round trips per comm before measuring
    timeout_s: float
    comms: int = 1  # concurrent comms: flood's senders, nchains' chains
    settle_s: float = 0.0  # idle: untimed seconds between "cluster up" and measuring


@dataclass(frozen=True)
class Server:
    """Where the client connects, and the lci provider its comms must use."""

    address: str
    provider: str | None = None


class WrongProvider(RuntimeError):
    """A comm runs over another lci provider than the one pinned."""


@dataclass(frozen=True)
class Measurement:
    """``count`` operations in ``seconds``; ``idle`` counts processes and their ``cpu_seconds``."""

    count: int
    seconds: float
    cpu_seconds: float | None = None


RunSpecs = Callable[[Connection, Server, list[BenchSpec]], Coroutine[Any, Any, None]]


async def server_main(conn: Connection, scheme: str, listeners: int = 1) -> None:
    """Echo/sink server on ``listeners`` listeners (``("ready", addresses)``) until the parent
    closes the pipe (or sends anything)."""
    started = [listen(f"{scheme}://127.0.0.1:0", _handle_comm) for _ in range(listeners)]
    for listener in started:
        await listener.start()
    try:
        conn.send(("ready", [listener.contact_address for listener in started]))
        await asyncio.to_thread(conn.recv)
    except (EOFError, OSError):
        pass  # the parent closed its end
    finally:
        for listener in started:
            stopped = listener.stop()
            if inspect.isawaitable(stopped):
                await stopped


async def _handle_comm(comm: Any) -> None:
    """Echo ``ping``s; count ``flood``s and answer ``flood-end`` with the count: none is lost."""
    flooded = 0
    try:
        while True:
            msg = await comm.read()
            op = msg["op"]
            if op == "ping":
                await comm.write(make_message("pong", msg["x"]), serializers=SERIALIZERS)
            elif op == "flood":
                flooded += 1
            elif op == "flood-end":
                await comm.write({"op": "flood-done", "count": flooded})
                flooded = 0
            else:
                raise ValueError(f"unknown op {op!r}")
    except CommClosedError:
        pass  # the client is done with this comm
    finally:
        await _close(comm)


def client_main(conn: Connection, run_specs: RunSpecs | None = None) -> None:
    """Wait for the :class:`Server` and the specs, then run them on a fresh loop: by default,
    answering ``("result", name, Measurement)`` or ``("failed", name, reason)`` to each in order."""
    try:
        server, specs = conn.recv()
    except (EOFError, OSError):
        return  # the parent gave up before sending work
    asyncio.run((run_specs or _run_specs)(conn, server, specs))


async def _run_specs(conn: Connection, server: Server, specs: list[BenchSpec]) -> None:
    for spec in specs:
        try:
            measurement = await asyncio.wait_for(measure(server, spec), spec.timeout_s)
        except asyncio.TimeoutError:
            conn.send(("failed", spec.name, f"timed out after {spec.timeout_s:g} s"))
        except Exception as exc:
            conn.send(("failed", spec.name, f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("result", spec.name, measurement))


def bounded(max_count: int, deadline: float) -> Iterator[int]:
    """Yield 0, 1, 2, ... until ``max_count`` or ``deadline`` (at least once)."""
    for i in range(max_count):
        if i and perf_counter() >= deadline:
            return
        yield i


def make_payload(nbytes: int) -> np.ndarray:
    """Zeros for tiny messages (as Dask sends); random bytes for large ones, which no
    compressing configuration can shrink."""
    if nbytes <= 64:
        return np.zeros(nbytes, dtype="u1")
    return np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype="u1")


def make_message(op: str, payload: np.ndarray) -> dict[str, Any]:
    return {"op": op, "x": to_serialize(payload)}


@asynccontextmanager
async def connected_many(server: Server, n: int) -> AsyncIterator[list[Any]]:
    """``n`` comms to ``server``, each checked to run over its provider."""
    comms: list[Any] = []
    try:
        for _ in range(n):
            comm = await connect(server.address, timeout=CONNECT_TIMEOUT_S)
            comms.append(comm)
            check_provider(comm, server.provider)
        yield comms
    finally:
        await asyncio.gather(*(_close(c) for c in comms))


def check_provider(comm: Any, wanted: str | None) -> None:
    got = comm.extra_info.get("provider")
    if wanted is not None and got != wanted:
        raise WrongProvider(f"{comm.peer_address}: comm runs over provider {got!r}, not "
                            f"{wanted!r} (lci fell back; its log above says why)")


async def _close(comm: Any) -> None:
    try:
        await comm.close()
    except Exception:
        comm.abort()


async def ping(comm: Any, msg: dict[str, Any], max_count: int, deadline: float) -> int:
    """Do bounded round trips of ``msg``; return how many completed."""
    done = 0
    for _ in bounded(max_count, deadline):
        await comm.write(msg, serializers=SERIALIZERS)
        reply = await comm.read()
        if reply["op"] != "pong":
            raise RuntimeError(f"unexpected reply {reply['op']!r}")
        done += 1
    return done


async def _flood_one(comm: Any, msg: dict[str, Any], max_count: int, deadline: float) -> int:
    """Bounded one-way writes, counted once the server confirmed them all (not buffered)."""
    sent = 0
    for _ in bounded(max_count, deadline):
        await comm.write(msg, serializers=SERIALIZERS)
        sent += 1
    await comm.write({"op": "flood-end"})
    reply = await comm.read()
    if reply.get("count") != sent:
        raise RuntimeError(f"server received {reply.get('count')} of {sent} messages")
    return sent


#: Per kind, the timed message's op and what each comm does with it until the
#: deadline: ping-pong on one comm; flood and nchains on ``spec.comms`` at once.
KERNELS: dict[str, tuple[str, Callable[..., Awaitable[int]]]] = {
    "pingpong": ("ping", ping), "flood": ("flood", _flood_one), "nchains": ("ping", ping)}


async def measure(server: Server, spec: BenchSpec) -> Measurement:
    """Warm-up round trips on every comm, then the kernel on all of them at once."""
    op, loop = KERNELS[spec.kind]
    payload = make_payload(spec.payload_bytes)
    async with connected_many(server, spec.comms) as comms:
        warm = make_message("ping", payload)  # untimed: lazy setup (buffers, registration) is not timed
        await asyncio.gather(*(ping(c, warm, spec.warmup, math.inf) for c in comms))
        msg = make_message(op, payload)
        start = perf_counter()
        deadline = start + spec.duration_s
        counts = await asyncio.gather(*(loop(c, msg, spec.max_count, deadline) for c in comms))
        return Measurement(sum(counts), perf_counter() - start)
