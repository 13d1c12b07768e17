"""The emulated cluster of ``python -m benchmarks asap`` and ``workloads``: a
scheduler and N single-threaded workers started as processes, ``per_host``
workers on each simulated host when network namespaces can be made (root and
iproute2), else all on loopback.

On simulated hosts (:mod:`dask_lcicomm.testing.netns`, shared with the
multi-host tests) every worker has its own address on a private bridge and
its egress limited by ``tc tbf``; the scheduler listens in the root namespace
on the bridge's address. Everything started here is stopped, and every
namespace removed, when the ``with`` block ends, whether it ends normally, by
an error, or by KeyboardInterrupt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import dask

from dask_lcicomm.testing.netns import Host, gateway_address, unavailable, virtual_hosts

#: A subnet of its own, so that a multi-host test running meanwhile cannot collide.
SUBNET = "10.214.0.0/24"
STARTUP_S = 90.0
#: More per worker: 32 of them importing Dask on two cores took 45 s here.
STARTUP_PER_WORKER_S = 3.0
STOP_S = 10.0
#: UCX leaves bridge devices out of its TCP transport unless told otherwise, and
#: the root namespace (the scheduler's, and the client's where one runs there)
#: reaches the simulated hosts only through the bridge: without this, a ucxx
#: client there failed every connection with "Destination is unreachable".
#: Set for every process started while a testbed on namespaces is up, unless
#: the environment says otherwise.
UCX_USES_THE_BRIDGE = {"UCX_TCP_BRIDGE_ENABLE": "y"}
#: What ASAP's workers run with: no nanny, no memory limit.
BARE_WORKERS = ("--no-nanny", "--memory-limit", "0")


@dataclass(frozen=True)
class Testbed:
    scheduler: str  # the scheduler's address
    kind: str  # what the workers run on, for the report
    workers: int
    #: Bytes resident in the testbed's processes now (scheduler and workers).
    rss: Callable[[], int]


def _python_module(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


class _Processes:
    """Processes of the testbed, each in its own session, killed as a group."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], host: Host | None) -> None:
        with open(self.logdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                host.command(argv) if host is not None else argv,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_environment(), start_new_session=True,
            )
        self.started.append((name, proc))

    def rss(self) -> int:
        import psutil

        total = 0
        for _, proc in self.started:
            try:
                total += psutil.Process(proc.pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def check(self) -> None:
        for name, proc in self.started:
            if proc.poll() is not None:
                log = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")

    def stop(self) -> None:
        """Workers first (so that none tries to reach a departed scheduler),
        then the scheduler; whatever is left after ``STOP_S`` is killed."""
        workers = [p for name, p in self.started if name != "scheduler"]
        schedulers = [p for name, p in self.started if name == "scheduler"]
        for group in (workers, schedulers):
            for proc in group:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + STOP_S
            for proc in group:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        for _, proc in self.started:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=STOP_S)


def _environment() -> dict[str, str]:
    """This process's environment plus what Dask's nanny sets before it starts
    a worker (``distributed.nanny.pre-spawn-environ``: one BLAS thread): the
    workers here run without a nanny. Without it OpenBLAS gives each worker a
    second thread that spins between matrix products: with 32 workers on two
    cores, 220 asap rounds of the MLP took 139 s with it and 41 s without."""
    spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
    return {**os.environ, **{k: str(v) for k, v in spawn.items()}, "PYTHONUNBUFFERED": "1"}


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _scheduler_address(path: Path, procs: _Processes) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        procs.check()
        try:
            address = json.loads(path.read_text()).get("address")
        except (OSError, ValueError):
            address = None
        if address:
            return address
        time.sleep(0.1)
    raise RuntimeError(f"the scheduler wrote no address within {STARTUP_S:.0f} s")


def _wait_for_workers(address: str, nworkers: int) -> None:
    """Wait in a child process, so that this one keeps no comm state of the
    testbed's scheme: a UCX context, once made, knows only the network devices
    there were, and the next testbed's bridge is a new device it cannot use."""
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
    """Start the cluster; ``rate`` (a tc rate, e.g. ``"100mbit"``) limits each
    simulated host's egress. ``loopback``, or no way to make namespaces,
    runs every process on 127.0.0.1 without any limit. The scheduler runs in
    the root namespace, on the bridge's address: a host of its own whose
    egress is not limited. ``worker_options`` go to every ``dask worker``.
    Processes started inside the ``with`` block inherit what the testbed
    sets in the environment (:data:`UCX_USES_THE_BRIDGE`)."""
    why_not = "loopback requested" if loopback else unavailable()
    logdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if why_not is None:
            made = stack.enter_context(virtual_hosts(-(-nworkers // per_host), SUBNET, rate))
            stack.enter_context(mock.patch.dict(
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
        procs.start("scheduler", _python_module("distributed.cli.dask_scheduler", [
            "--protocol", protocol, "--host", scheduler_host, "--port", "0", "--no-dashboard",
            "--scheduler-file", str(scheduler_file)]), None)
        address = _scheduler_address(scheduler_file, procs)
        for i, host in enumerate(hosts):
            procs.start(f"worker{i}", _python_module("distributed.cli.dask_worker", [
                address, "--nthreads", "1", *worker_options, "--no-dashboard",
                "--host", host.address if host else "127.0.0.1",
                "--name", f"worker-{i}", "--death-timeout", "60",
                "--local-directory", str(logdir / f"worker{i}")]), host)
        _wait_for_workers(address, nworkers)
        procs.check()
        yield Testbed(address, kind, nworkers, procs.rss)
