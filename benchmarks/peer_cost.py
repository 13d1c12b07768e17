"""What one more peer costs a process in descriptors and RSS, per comm configuration (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
_MODULE = "benchmarks.peer_cost"
_LCI = "DASK_DISTRIBUTED__COMM__LCI__"
CONFIGS: dict[str, tuple[str, dict[str, str], str | None]] = {  # name: (scheme, environment, needs)
    "tcp": ("tcp", {}, None), "ucxx": ("ucxx", {}, "distributed_ucxx"), "lci": ("lci", {}, None),
    "lci-tcp": ("lci", {f"{_LCI}PROVIDERS": "[tcp]"}, None),
    "lci-ucx": ("lci", {f"{_LCI}PROVIDERS": "[ucx]"}, "ucxx"),
    "lci-ofi": ("lci", {f"{_LCI}PROVIDERS": "[ofi]", f"{_LCI}OFI__NODE": "127.0.0.1",
                        f"{_LCI}OFI__PROVIDER": "tcp;ofi_rxm"}, "dask_lcicomm.providers._ofi"),
}
MESSAGE = {"op": "ping", "x": 1}
_ADDRESSES = "addresses:"
#: Seconds a server has to print its addresses, then to exit once its input closes; the measurement's.
_START_S, _STOP_S, _MEASURE_S = 120, 30, 300.0


def proc_bytes(path: str, field: str) -> int:
    """A field in kB of a /proc file (``VmRSS:`` of /proc/self/status...), in bytes."""
    with open(path) as file:
        return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))


def config_names(parser: argparse.ArgumentParser, text: str, known: dict[str, Any]) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if unknown := [name for name in names if name not in known]:
        parser.error(f"unknown configurations {unknown}; known: {list(known)}")
    return names


def run_module(name: str, module: str, argv: list[str], env: dict[str, str], timeout_s: float) -> Any:
    """Configuration ``name``'s ``python -m module *argv`` with ``env``: its last line, as JSON."""
    done = subprocess.run([sys.executable, "-m", module, *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _serve(scheme: str, count: int) -> None:
    """Hold ``count`` listeners, each echoing one message, until standard input closes."""
    from distributed.comm import listen
    from distributed.comm.core import CommClosedError

    async def echo(comm: Any) -> None:
        with contextlib.suppress(CommClosedError):
            await comm.write(await comm.read())
            await comm.read()  # keeps the comm until the measuring process closes it

    signal.alarm(_START_S)  # SIGALRM ends a server stuck before it prints its addresses...
    listeners = [await listen(f"{scheme}://127.0.0.1:0", echo) for _ in range(count)]  # awaited: started
    print(_ADDRESSES, json.dumps([listener.contact_address for listener in listeners]), flush=True)
    signal.alarm(0)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    signal.alarm(_STOP_S)  # ...or stuck stopping: the driver's wait for it is bounded
    for listener in listeners:
        listener.stop()


async def _measure(addresses: list[str]) -> dict[str, Any]:
    """Descriptors and RSS after a round trip with the first peer and with the last."""
    from distributed.comm import connect

    comms: list[Any] = []
    usage: list[tuple[int, int]] = []
    for address in addresses:
        comms.append(comm := await connect(address))
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


def _addresses(server: subprocess.Popen[str]) -> list[str]:
    """The marked line a server prints, past what else it prints (UCX prints warnings on stdout)."""
    for line in server.stdout or ():
        if line.startswith(_ADDRESSES):
            return list(json.loads(line[len(_ADDRESSES):]))
    raise RuntimeError("a server ended without printing its addresses")


def _one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A configuration in fresh processes: the servers, then the measurement."""
    scheme, env, _ = CONFIGS[name]
    serve = [sys.executable, "-m", _MODULE, "--serve", scheme, "--peers", str(-(-args.peers // args.servers))]
    with contextlib.ExitStack() as stack:  # on leaving, closes each server's input and waits for it
        servers = [stack.enter_context(subprocess.Popen(serve, env={**os.environ, **env}, text=True,
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)) for _ in range(args.servers)]
        addresses = [address for server in servers for address in _addresses(server)][: args.peers]
        return run_module(name, _MODULE, ["--measure", json.dumps(addresses)], env, _MEASURE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__)
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the scheme
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the addresses
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve, args.peers))
        return 0
    if args.measure:
        print(json.dumps(asyncio.run(_measure(json.loads(args.measure)))))
        return 0
    if args.peers < 2 or args.servers < 1:
        parser.error("--peers must be at least 2 and --servers at least 1")
    results: dict[str, Any] = {}
    for name in config_names(parser, args.configs, CONFIGS):
        needs = CONFIGS[name][2]
        if needs and importlib.util.find_spec(needs) is None:
            results[name] = {"skipped": f"{needs} is not installed"}
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = _one(name, args)
    print(f"| per peer ({args.peers} peers in {args.servers} processes) | descriptors | RSS, MiB |")
    print("|---|---|---|")
    for name, r in results.items():
        row = (f"{r['skipped']} |" if "skipped" in r
               else f"{r['fds_per_peer']:.2f} | {r['rss_mib_per_peer']:.3f}")
        print(f"| {name} | {row} |")
    if args.json:
        summary = {"peers": args.peers, "servers": args.servers, "results": results}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
