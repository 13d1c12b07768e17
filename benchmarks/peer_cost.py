"""What one more peer costs a process in descriptors and RSS, per comm configuration (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

from distributed.comm import connect

from benchmarks import _runner
from benchmarks._comm_peers import check_provider, server_main
from benchmarks._contenders import Configuration, probe
from benchmarks._procs import expect, run_in_child, spawned
from benchmarks._sampler import proc_bytes
from benchmarks.comm import OFI, OFI_MODULE, variant
from benchmarks.report import markdown_table

MiB = 1 << 20
CONFIGS = {c.label: c for c in (
    *map(Configuration.of_scheme, ("tcp", "ucxx", "lci")), variant("lci-tcp", {"providers": ["tcp"]}),
    variant("lci-ucx", {"providers": ["ucx"]}, requires="ucxx"),
    variant("lci-ofi", {"providers": ["ofi"], **OFI}, requires=OFI_MODULE))}
MESSAGE, ECHO = {"op": "ping", "x": 1}, {"op": "pong", "x": 1}  # what the comm peers' server echoes
_START_S, _MEASURE_S = 120.0, 300.0  # for the servers to listen; for the measurement


async def _measure(addresses: list[str], provider: str | None) -> dict[str, Any]:
    """Descriptors and RSS after a round trip with the first peer and with the last."""
    comms: list[Any] = []
    usage: list[tuple[int, int]] = []
    for address in addresses:
        comms.append(comm := await connect(address))
        check_provider(comm, provider)
        await comm.write(MESSAGE)
        if await comm.read() != ECHO:
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
        started = [stack.enter_context(spawned(server_main, c.scheme, -(-peers // servers),
                                               name=f"{c.label}-{i}", dask_config=c.overrides))
                   for i in range(servers)]
        addresses = [address for server in started for address in expect(server, "ready", _START_S)]
        return run_in_child(_measure, addresses[:peers], c.provider, name=c.label,
                            dask_config=c.overrides, timeout_s=_MEASURE_S)


def main(argv: list[str] | None = None) -> int:
    parser = _runner.tool_parser("peer_cost", __doc__, CONFIGS, tuple(CONFIGS))
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--servers", type=_runner.positive, default=4)
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    configs = [CONFIGS[name] for name in args.configs]
    status = probe(configs)
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
