"""The client peer of ``budget``: the comm benchmark's ping-pong, held open
for as long as the parent profiles it.

The server is the comm benchmark's echo server, and the round trip is the
comm benchmark's (:func:`benchmarks._comm_peers.pingpong`: same message, same
serializers, same warm-up, same timed window).  What is added is a second
loop that runs until the parent says ``stop``: the parent cannot know when
py-spy has attached, so the loop must outlast the recording rather than end
at a guessed time.  Per payload, the client reports::

    ("looping", name, None)             the profiled loop has started
    ("result", name, LoopResult)        after the parent's ("stop",)
    ("failed", name, reason)            instead, at any point
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from multiprocessing.connection import Connection
from time import perf_counter
from typing import Any

from benchmarks._comm_peers import (
    BenchSpec,
    Measurement,
    Server,
    connected_many,
    make_message,
    make_payload,
    ping,
    run_client,
    timed_pings,
    warm_up,
)
from benchmarks._procs import send_quietly

__all__ = ["LoopResult", "client_main"]


@dataclass(frozen=True)
class LoopResult:
    """Round trips of the unprofiled window and of the profiled loop, and the
    lci provider the comm used (None for other schemes)."""

    reference: Measurement
    profiled: Measurement
    provider: str | None


def client_main(conn: Connection) -> None:
    """Process entry point: one payload after the other, each on a fresh comm;
    a spec's ``duration_s`` is the unprofiled window, ``timeout_s`` bounds
    everything, the profiled loop included."""
    run_client(conn, _run_specs)


async def _run_specs(conn: Connection, server: Server, specs: list[BenchSpec]) -> None:
    for spec in specs:
        try:
            result = await asyncio.wait_for(_measure(conn, server, spec), spec.timeout_s)
        except Exception as exc:  # a timeout too: the next payload gets a fresh comm
            send_quietly(conn, ("failed", spec.name, f"{type(exc).__name__}: {exc}"))
        else:
            send_quietly(conn, ("result", spec.name, result))


async def _measure(conn: Connection, server: Server, spec: BenchSpec) -> LoopResult:
    msg = make_message("ping", make_payload(spec.payload_bytes))
    async with connected_many(server, 1) as (comm,):
        await warm_up(comm, msg, spec.warmup)
        reference = await timed_pings(comm, msg, spec)
        conn.send(("looping", spec.name, None))
        profiled = await _pings_until_stopped(conn, comm, msg)
        return LoopResult(reference, profiled, comm.extra_info.get("provider"))


async def _pings_until_stopped(conn: Connection, comm: Any, msg: dict[str, Any]) -> Measurement:
    """Round trips until the parent's ``stop`` (or its end of the pipe
    closing) arrives; the caller's timeout bounds the loop."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    loop.add_reader(conn.fileno(), stopped.set)
    try:
        start = perf_counter()
        count = 0
        while not stopped.is_set():
            count += await ping(comm, msg, 1, math.inf)
        seconds = perf_counter() - start
    finally:
        loop.remove_reader(conn.fileno())
    try:
        conn.recv()  # the "stop" itself
    except (EOFError, OSError):
        pass  # the parent is gone; nobody reads the result either
    return Measurement(count, seconds)
