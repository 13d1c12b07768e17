"""Code that runs inside the benchmark peer processes (server and client).

Both sides speak only through the public ``distributed.comm`` API, so the very
same code measures every scheme.  The wire contract with the parent process is
made of :class:`BenchSpec` (what to measure) and :class:`Measurement` (raw
count and seconds); turning those into rates happens in the parent, in one
place (:mod:`benchmarks.comm`).

Messages on the comm all have the shape ``{"op": ..., "x": to_serialize(arr)}``
written with ``serializers=("dask", "pickle")``, i.e. what Dask itself sends
for small task payloads.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
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
from benchmarks._procs import ignore_sigint, send_quietly

SERIALIZERS = ("dask", "pickle")

#: Seconds allowed for establishing one comm (connect + Dask handshake).
CONNECT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark and its budget; sent to the client process.

    Every measurement loop stops at ``max_count`` iterations or after
    ``duration_s`` seconds, whichever comes first (but runs at least once), so
    a slow backend yields a small sample instead of a hang.  ``timeout_s`` is
    the hard limit for the whole benchmark, connecting and warm-up included.
    The ``idle`` kind is not a client kernel: the parent runs it itself
    (:mod:`benchmarks._idle`), with ``duration_s`` as its idle window.
    """

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
    """Where the client connects, and the lci provider every comm to it must
    run over (None: whichever the scheme picks; see
    :attr:`benchmarks._configurations.Configuration.provider`)."""

    address: str
    provider: str | None = None


class WrongProvider(RuntimeError):
    """A comm runs over another lci provider than the configuration pins:
    measuring on would report the fallback's numbers under its label."""


@dataclass(frozen=True)
class Measurement:
    """Raw result: ``count`` operations completed in ``seconds`` wall time.

    The idle benchmark counts processes instead of operations and adds the
    ``cpu_seconds`` (user + system) they used in those ``seconds``.
    """

    count: int
    seconds: float
    cpu_seconds: float | None = None

    def summary(self) -> str:
        """The raw numbers, for the progress line."""
        if self.cpu_seconds is None:
            return f"{self.count} in {self.seconds:.2f} s"
        return f"{self.cpu_seconds:.3f} CPU s by {self.count} processes in {self.seconds:.2f} s"


# --------------------------------------------------------------------- server


def server_main(conn: Connection, scheme: str) -> None:
    """Process entry point: echo/sink server until the parent closes the pipe."""
    ignore_sigint()
    try:
        asyncio.run(_serve(conn, scheme))
    except Exception:
        send_quietly(conn, ("failed", traceback.format_exc()))


async def _serve(conn: Connection, scheme: str) -> None:
    listener = listen(f"{scheme}://127.0.0.1:0", _handle_comm)
    await listener.start()
    try:
        conn.send(("ready", listener.contact_address))
        await asyncio.to_thread(_wait_for_stop, conn)
    finally:
        stopped = listener.stop()
        if inspect.isawaitable(stopped):
            await stopped


def _wait_for_stop(conn: Connection) -> None:
    """Block until the parent closes its end (EOF) or sends anything at all."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass


async def _handle_comm(comm: Any) -> None:
    """Serve one comm: echo ``ping``s, count ``flood`` messages.

    ``flood-end`` is answered with the number of ``flood`` messages since the
    previous ``flood-end``, which lets the client check that none were lost.
    """
    flooded = 0
    try:
        while True:
            msg = await comm.read()
            op = msg["op"]
            if op == "ping":
                reply = {"op": "pong", "x": to_serialize(msg["x"])}
                await comm.write(reply, serializers=SERIALIZERS)
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


# --------------------------------------------------------------------- client


def client_main(conn: Connection) -> None:
    """Process entry point: run the benchmarks the parent sends, report each.

    Sends ``("result", name, Measurement)`` or ``("failed", name, reason)`` per
    benchmark, in order.  A failing benchmark does not stop the next one: each
    uses its own fresh comms.
    """
    run_client(conn, _run_specs)


SpecRunner = Callable[[Connection, Server, list[BenchSpec]], Coroutine[Any, Any, None]]


def run_client(conn: Connection, run_specs: SpecRunner) -> None:
    """A client process's body: wait for the :class:`Server` and the specs,
    then ``run_specs`` them on a fresh event loop."""
    ignore_sigint()
    try:
        server, specs = conn.recv()
    except (EOFError, OSError):
        return  # the parent gave up before sending work
    asyncio.run(run_specs(conn, server, specs))


async def _run_specs(conn: Connection, server: Server, specs: list[BenchSpec]) -> None:
    for spec in specs:
        try:
            kernel = KERNELS[spec.kind]
            measurement = await asyncio.wait_for(kernel(server, spec), spec.timeout_s)
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
    """Zeros for tiny messages (as Dask sends); random bytes for large ones so
    that a compressing configuration cannot make one scheme look faster."""
    if nbytes <= 64:
        return np.zeros(nbytes, dtype="u1")
    return np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype="u1")


def make_message(op: str, payload: np.ndarray) -> dict[str, Any]:
    return {"op": op, "x": to_serialize(payload)}


@asynccontextmanager
async def connected_many(server: Server, n: int) -> AsyncIterator[list[Any]]:
    """``n`` comms to ``server``, opened one after the other (connecting is
    not what is measured), each checked to run over the server's provider;
    all closed on exit."""
    comms: list[Any] = []
    try:
        for _ in range(n):
            comms.append(await connect(server.address, timeout=CONNECT_TIMEOUT_S))
            check_provider(comms[-1], server.provider)
        yield comms
    finally:
        await asyncio.gather(*(_close(c) for c in comms))


def check_provider(comm: Any, wanted: str | None) -> None:
    """Raise :class:`WrongProvider` unless ``comm`` runs over ``wanted`` (if
    given), as its ``extra_info`` says."""
    got = comm.extra_info.get("provider")
    if wanted is not None and got != wanted:
        raise WrongProvider(f"{comm.peer_address}: comm runs over provider {got!r}, not "
                            f"{wanted!r} (lci fell back; its log above says why)")


async def _close(comm: Any) -> None:
    """Close ``comm``, ignoring errors: the peer may already be gone."""
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


async def warm_up(comm: Any, msg: dict[str, Any], rounds: int) -> None:
    """Untimed round trips, so lazy setup (buffers, registration) is not timed."""
    if rounds > 0:
        await ping(comm, msg, rounds, math.inf)


async def timed_pings(comm: Any, msg: dict[str, Any], spec: BenchSpec) -> Measurement:
    start = perf_counter()
    count = await ping(comm, msg, spec.max_count, start + spec.duration_s)
    return Measurement(count, perf_counter() - start)


async def pingpong(server: Server, spec: BenchSpec) -> Measurement:
    """Sequential round trips of one message on one comm (latency-bound for
    small payloads, bandwidth-bound for large ones)."""
    msg = make_message("ping", make_payload(spec.payload_bytes))
    async with connected_many(server, 1) as (comm,):
        await warm_up(comm, msg, spec.warmup)
        return await timed_pings(comm, msg, spec)


async def flood(server: Server, spec: BenchSpec) -> Measurement:
    """Back-to-back one-way writes on ``spec.comms`` comms at once, timed from
    the first write until the server acknowledged every comm's last message,
    so buffered-but-undelivered messages cannot inflate the rate."""
    payload = make_payload(spec.payload_bytes)
    async with connected_many(server, spec.comms) as comms:
        await asyncio.gather(*(warm_up(c, make_message("ping", payload), spec.warmup)
                               for c in comms))
        msg = make_message("flood", payload)
        start = perf_counter()
        deadline = start + spec.duration_s
        sent = await asyncio.gather(*(_flood_one(c, msg, spec.max_count, deadline)
                                      for c in comms))
        return Measurement(sum(sent), perf_counter() - start)


async def _flood_one(comm: Any, msg: dict[str, Any], max_count: int, deadline: float) -> int:
    """Bounded one-way writes on one comm; how many the server confirmed."""
    sent = 0
    for _ in bounded(max_count, deadline):
        await comm.write(msg, serializers=SERIALIZERS)
        sent += 1
    await comm.write({"op": "flood-end"})
    reply = await comm.read()
    if reply.get("count") != sent:
        raise RuntimeError(f"server received {reply.get('count')} of {sent} messages")
    return sent


async def nchains(server: Server, spec: BenchSpec) -> Measurement:
    """``spec.comms`` comms doing round trips concurrently: latency under
    load, stressing per-comm overhead and the backend's progress engine."""
    msg = make_message("ping", make_payload(spec.payload_bytes))
    async with connected_many(server, spec.comms) as comms:
        await asyncio.gather(*(warm_up(c, msg, max(spec.warmup, 1)) for c in comms))
        start = perf_counter()
        deadline = start + spec.duration_s
        counts = await asyncio.gather(
            *(ping(c, msg, spec.max_count, deadline) for c in comms)
        )
        return Measurement(sum(counts), perf_counter() - start)


KERNELS: dict[str, Callable[[Server, BenchSpec], Awaitable[Measurement]]] = {
    "pingpong": pingpong,
    "flood": flood,
    "nchains": nchains,
}
