"""What one more peer costs a process in descriptors and RSS, per comm configuration (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from distributed.comm import connect, listen
from distributed.comm.core import CommClosedError

from benchmarks import _runner
from benchmarks._comm_peers import check_provider, server_main
from benchmarks._contenders import Configuration, probe
from benchmarks._procs import expect, spawned
from benchmarks.comm import OFI, OFI_MODULE, variant
from benchmarks.report import markdown_table

MiB = 1 << 20
CONFIGS = {c.label: c for c in (
    *map(Configuration.of_scheme, ("tcp", "ucxx", "lci")), variant("lci-tcp", {"providers": ["tcp"]}),
    variant("lci-ucx", {"providers": ["ucx"]}, requires="ucxx"),
    variant("lci-ofi", {"providers": ["ofi"], **OFI}, requires=OFI_MODULE))}
MESSAGE = {"op": "ping", "x": 1}
_START_S, _MEASURE_S = 120.0, 300.0  # for the servers to listen; for the measurement


def proc_bytes(path: str, field: str) -> int:
    """A field in kB of a /proc file (``VmRSS:`` of /proc/self/status...), in bytes."""
    with open(path) as file:
        return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))


def in_child(c: Configuration, work: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``work(*args)`` (awaited if a coroutine function) in a fresh process with ``c``'s Dask
    settings, which may start processes of its own: its result, else a PeerError."""
    with spawned(_answer, work, *args, name=f"{c.label}-{work.__name__}", dask_config=c.overrides,
                 daemon=False) as child:
        return expect(child, "result", timeout_s)


def _answer(conn: Connection, work: Callable[..., Any], *args: Any) -> None:
    conn.send(("result", asyncio.run(work(*args)) if inspect.iscoroutinefunction(work) else work(*args)))


def _serve(conn: Connection, scheme: str, count: int) -> None:
    """Child: ``count`` listeners, each echoing one message, until the parent closes the pipe."""
    asyncio.run(_listen(conn, scheme, count))


async def _listen(conn: Connection, scheme: str, count: int) -> None:
    async def echo(comm: Any) -> None:
        with contextlib.suppress(CommClosedError):
            await comm.write(await comm.read())
            await comm.read()  # keeps the comm until the measuring process closes it

    listeners = [await listen(f"{scheme}://127.0.0.1:0", echo) for _ in range(count)]  # awaited: started
    conn.send(("ready", [listener.contact_address for listener in listeners]))
    with contextlib.suppress(EOFError, OSError):
        await asyncio.to_thread(conn.recv)
    for listener in listeners:
        listener.stop()


async def _measure(addresses: list[str], provider: str | None) -> dict[str, Any]:
    """Descriptors and RSS after a round trip with the first peer and with the last."""
    comms: list[Any] = []
    usage: list[tuple[int, int]] = []
    for address in addresses:
        comms.append(comm := await connect(address))
        check_provider(comm, provider)
        await comm.write(MESSAGE)
        if await comm.read() != MESSAGE:
            raise RuntimeError(f"wrong echo from {address}")
        if len(comms) in (1, len(addresses)):
            gc.collect()
            usage.append((len(os.listdir("/proc/self/fd")), proc_bytes("/proc/self/status", "VmRSS:")))
    for comm in comms:
        await comm.close()
    (fds_first, rss_first), (fds_last, rss_last) = usage
    peers = len(addresses) - 1
    return {"fds_per_peer": (fds_last - fds_first) / peers,
            "rss_mib_per_peer": (rss_last - rss_first) / peers / MiB,
            "fds_first": fds_first, "rss_mib_first": rss_first / MiB}


def _one(c: Configuration, peers: int, servers: int) -> dict[str, Any]:
    """A configuration in fresh processes: the servers, then the measurement."""
    with contextlib.ExitStack() as stack:  # on leaving, stops the servers
        started = [stack.enter_context(spawned(_serve, c.scheme, -(-peers // servers), name=f"{c.label}-{i}",
                                               dask_config=c.overrides)) for i in range(servers)]
        addresses = [address for server in started for address in expect(server, "ready", _START_S)]
        return in_child(c, _measure, addresses[:peers], c.provider, timeout_s=_MEASURE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_cost", description=__doc__)
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--servers", type=_runner.positive, default=4)
    parser.add_argument("--configs", type=_runner.subset(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    configs = [CONFIGS[name] for name in args.configs]
    status = probe(configs, server_main)
    results: dict[str, Any] = {}
    for c in configs:
        if not status[c.label].available:
            results[c.label] = {"skipped": f"{status[c.label].label}: {status[c.label].detail}"}
            continue
        _runner.progress(f"{c.label} ...")
        results[c.label] = _one(c, args.peers, args.servers)
    head = [f"per peer ({args.peers} peers in {args.servers} processes)", "descriptors", "RSS, MiB"]
    print(markdown_table(head, ([name, r["skipped"], ""] if "skipped" in r else
                                [name, f"{r['fds_per_peer']:.2f}", f"{r['rss_mib_per_peer']:.3f}"]
                                for name, r in results.items())))
    if args.json:
        _runner.write_json(args.json, {"peers": args.peers, "servers": args.servers, "results": results}, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
