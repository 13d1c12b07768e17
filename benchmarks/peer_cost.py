"""What one more peer costs a process: descriptors and resident memory.

``python -m benchmarks.peer_cost [--peers 64] [--servers 4] [--configs ...] [--json OUT]``

One process opens a comm to each of ``--peers`` listeners held by
``--servers`` other processes, does one round trip of a small message on
each, and reads its descriptors (``/proc/self/fd``) and ``VmRSS`` after the
first peer and after the last: the cost per peer is the difference over the
peers after the first. Every configuration runs in fresh processes, with its
environment given to the servers too:

* ``tcp``, ``ucxx``: Dask's comms (``ucxx`` where distributed-ucxx is installed);
* ``lci``: lci as configured by default (shm on one host);
* ``lci-tcp``, ``lci-ucx``, ``lci-ofi``: lci with ``providers: [tcp]``, ``[ucx]``
  or ``[ofi]`` (libfabric's tcp provider on loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
_PROVIDERS = "DASK_DISTRIBUTED__COMM__LCI__PROVIDERS"
CONFIGS: dict[str, tuple[str, dict[str, str], str | None]] = {
    # name: (scheme, environment, module it needs)
    "tcp": ("tcp", {}, None),
    "ucxx": ("ucxx", {}, "distributed_ucxx"),
    "lci": ("lci", {}, None),
    "lci-tcp": ("lci", {_PROVIDERS: "[tcp]"}, None),
    "lci-ucx": ("lci", {_PROVIDERS: "[ucx]"}, "ucxx"),
    "lci-ofi": ("lci", {_PROVIDERS: "[ofi]", "DASK_DISTRIBUTED__COMM__LCI__OFI__NODE": "127.0.0.1",
                        "DASK_DISTRIBUTED__COMM__LCI__OFI__PROVIDER": "tcp;ofi_rxm"},
                "dask_lcicomm.providers._ofi"),
}
MESSAGE = {"op": "ping", "x": 1}
_ADDRESSES = "addresses:"


def _usage() -> tuple[int, int]:
    """Open descriptors and resident bytes of this process."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    return len(os.listdir("/proc/self/fd")), rss


async def _serve(scheme: str, count: int) -> None:
    """Hold ``count`` echoing listeners until standard input closes."""
    from distributed.comm import listen
    from distributed.comm.core import CommClosedError

    async def echo(comm: Any) -> None:
        try:
            while True:
                await comm.write(await comm.read())
        except CommClosedError:
            pass

    listeners = [await listen(f"{scheme}://127.0.0.1:0", echo) for _ in range(count)]
    for listener in listeners:
        await listener.start()
    # UCX prints its warnings on stdout: the addresses are the marked line.
    print(_ADDRESSES, json.dumps([listener.contact_address for listener in listeners]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for listener in listeners:
        listener.stop()


async def _measure(addresses: list[str]) -> dict[str, Any]:
    from distributed.comm import connect

    comms = []
    usage = []
    for address in addresses:
        comm = await connect(address)
        await comm.write(MESSAGE)
        if await comm.read() != MESSAGE:
            raise RuntimeError(f"wrong echo from {address}")
        comms.append(comm)
        if len(comms) in (1, len(addresses)):
            gc.collect()
            usage.append(_usage())
    (fds_first, rss_first), (fds_last, rss_last) = usage
    for comm in comms:
        await comm.close()
    peers = len(addresses) - 1
    return {"fds_per_peer": (fds_last - fds_first) / peers,
            "rss_mib_per_peer": (rss_last - rss_first) / peers / MiB,
            "fds_first": fds_first, "rss_mib_first": rss_first / MiB}


def _addresses(server: subprocess.Popen[str]) -> list[str]:
    """The addresses a server prints, past whatever else it printed."""
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith(_ADDRESSES):
            return list(json.loads(line[len(_ADDRESSES):]))
    raise RuntimeError("a server ended without printing its addresses")


def _one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A configuration in fresh processes: the servers, then the measurement."""
    scheme, env, _ = CONFIGS[name]
    environment = {**os.environ, **env}
    per_server = -(-args.peers // args.servers)
    servers = [subprocess.Popen([sys.executable, "-m", "benchmarks.peer_cost", "--serve", scheme,
                                 "--peers", str(per_server)], env=environment, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
               for _ in range(args.servers)]
    try:
        addresses = [a for server in servers for a in _addresses(server)]
        done = subprocess.run([sys.executable, "-m", "benchmarks.peer_cost", "--measure",
                               json.dumps(addresses[: args.peers])],
                              env=environment, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for server in servers:
            server.stdin.close()  # type: ignore[union-attr]
        for server in servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve, args.peers))
        return 0
    if args.measure:
        print(json.dumps(asyncio.run(_measure(json.loads(args.measure)))))
        return 0
    if args.peers < 2 or args.servers < 1:
        parser.error("--peers must be at least 2 and --servers at least 1")
    names = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    results: dict[str, Any] = {}
    for name in names:
        needs = CONFIGS[name][2]
        if needs and importlib.util.find_spec(needs) is None:
            results[name] = {"skipped": f"{needs} is not installed"}
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = _one(name, args)
    print(f"| per peer ({args.peers} peers in {args.servers} processes) | descriptors | RSS, MiB |")
    print("|---|---|---|")
    for name, result in results.items():
        if "skipped" in result:
            print(f"| {name} | {result['skipped']} | |")
        else:
            print(f"| {name} | {result['fds_per_peer']:.2f} | {result['rss_mib_per_peer']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"peers": args.peers, "servers": args.servers,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
