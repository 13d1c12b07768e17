"""The emulated cluster of ``python -m benchmarks asap`` and ``workloads``: a scheduler and
single-threaded workers as processes, ``per_host`` workers on each simulated host
(:mod:`dask_lcicomm.testing.netns`) when namespaces can be made, else all on loopback.
Everything started is stopped, and every namespace removed, however the ``with`` block ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import dask
import psutil

from dask_lcicomm.testing.netns import Host, gateway_address, unavailable, virtual_hosts

#: A subnet of its own, so that a multi-host test running meanwhile cannot collide.
SUBNET = "10.214.0.0/24"
#: Seconds to start, more per worker (32 importing Dask on two cores took 45 s), and to stop.
STARTUP_S, STARTUP_PER_WORKER_S, STOP_S = 90.0, 3.0, 10.0
#: UCX's TCP transport leaves bridges out unless told, and the root namespace (scheduler, client)
#: reaches the hosts only over the bridge: ucxx connections failed "Destination is unreachable".
UCX_USES_THE_BRIDGE = {"UCX_TCP_BRIDGE_ENABLE": "y"}
#: What ASAP's workers run with: no nanny, no memory limit.
BARE_WORKERS = ("--no-nanny", "--memory-limit", "0")


@dataclass(frozen=True)
class Testbed:
    scheduler: str  # the scheduler's address
    kind: str  # what the workers run on, for the report
    workers: int
    rss: Callable[[], int]  # bytes resident in the scheduler and the workers now


class _Processes(dict[str, subprocess.Popen]):
    """The testbed's processes by name, the scheduler first, each in a session of its own."""

    def __init__(self, logdir: Path) -> None:
        super().__init__()
        self.logdir = logdir

    def start(self, name: str, module: str, args: list[str], host: Host | None = None) -> None:
        argv = [sys.executable, "-m", module, *args]
        # What a nanny sets for its worker (one BLAS thread): without it each worker's second
        # OpenBLAS thread spun between products (32 workers, 220 asap rounds: 139 s, not 41 s).
        spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
        env = {**os.environ, **{k: str(v) for k, v in spawn.items()}, "PYTHONUNBUFFERED": "1"}
        with open(self.logdir / f"{name}.log", "wb") as log:
            self[name] = subprocess.Popen(host.command(argv) if host else argv, env=env,
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def rss(self) -> int:
        total = 0
        for proc in self.values():
            with suppress(psutil.Error):
                total += psutil.Process(proc.pid).memory_info().rss
        return total

    def check(self) -> None:
        for name, proc in self.items():
            if proc.poll() is not None:
                log = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")

    def stop(self) -> None:
        """Workers first, so that none reaches for a departed scheduler; killed after ``STOP_S``."""
        procs = list(self.values())
        for group, sig in ((procs[1:], signal.SIGTERM), (procs[:1], signal.SIGTERM),
                           (procs, signal.SIGKILL)):
            for proc in group:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            deadline = time.monotonic() + STOP_S
            for proc in group:
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))


def _scheduler_address(path: Path, procs: _Processes) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        procs.check()
        with suppress(OSError, ValueError):
            if address := json.loads(path.read_text()).get("address"):
                return str(address)
        time.sleep(0.1)
    raise RuntimeError(f"the scheduler wrote no address within {STARTUP_S:.0f} s")


def _wait_for_workers(address: str, nworkers: int) -> None:
    """In a child process: a UCX context made here would know only this testbed's bridge, and the
    next testbed's is a new device."""
    timeout = STARTUP_S + STARTUP_PER_WORKER_S * nworkers
    code = ("import sys; from distributed import Client\n"
            "with Client(sys.argv[1], timeout=float(sys.argv[3])) as client:\n"
            "    client.wait_for_workers(int(sys.argv[2]), timeout=float(sys.argv[3]))\n")
    try:
        done = subprocess.run([sys.executable, "-c", code, address, str(nworkers), str(timeout)],
                              capture_output=True, text=True, timeout=timeout + STARTUP_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{nworkers} workers did not join within {exc.timeout:.0f} s") from exc
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        raise RuntimeError(f"{nworkers} workers did not join {address}: {''.join(last)}")


@contextmanager
def testbed(nworkers: int, protocol: str, rate: str | None, logdir: Path,
            loopback: bool = False, per_host: int = 1,
            worker_options: tuple[str, ...] = BARE_WORKERS) -> Iterator[Testbed]:
    """The cluster, each simulated host's egress limited to ``rate`` (tc, e.g. ``"100mbit"``); the
    scheduler on the bridge's address in the root namespace, a host whose egress is free.
    ``loopback`` (or no namespaces) puts every process on 127.0.0.1 without a limit."""
    why_not = "loopback requested" if loopback else unavailable()
    logdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if why_not is None:
            made = stack.enter_context(virtual_hosts(-(-nworkers // per_host), SUBNET, rate))
            stack.enter_context(mock.patch.dict(  # processes started in the block inherit it
                os.environ, {k: v for k, v in UCX_USES_THE_BRIDGE.items() if k not in os.environ}))
            hosts: list[Host | None] = [made[i // per_host] for i in range(nworkers)]
            scheduler_host = gateway_address(SUBNET)
            kind = (f"{len(made)} network namespaces on a bridge, {per_host} worker(s) "
                    f"each, egress {rate or 'unlimited'} per host (tc tbf)")
        else:
            hosts, scheduler_host = [None] * nworkers, "127.0.0.1"
            kind = f"loopback, no bandwidth limit ({why_not})"
        procs = _Processes(logdir)
        stack.callback(procs.stop)
        scheduler_file = logdir / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)
        procs.start("scheduler", "distributed.cli.dask_scheduler", [
            "--protocol", protocol, "--host", scheduler_host, "--port", "0", "--no-dashboard",
            "--scheduler-file", str(scheduler_file)])
        address = _scheduler_address(scheduler_file, procs)
        for i, host in enumerate(hosts):
            procs.start(f"worker{i}", "distributed.cli.dask_worker", [
                address, "--nthreads", "1", *worker_options, "--no-dashboard",
                "--host", host.address if host else "127.0.0.1", "--name", f"worker-{i}",
                "--death-timeout", "60", "--local-directory", str(logdir / f"worker{i}")], host)
        _wait_for_workers(address, nworkers)
        procs.check()
        yield Testbed(address, kind, nworkers, procs.rss)
