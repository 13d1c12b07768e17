"""A ``LocalCluster`` and its ``Client`` kept up in a child process that
answers the parent's requests (``dask`` runs graphs on it), and the ``idle``
benchmark: the CPU time of that process tree while nothing happens, measured
from outside it, since a comm that wins by polling costs every other job.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import psutil

from benchmarks._comm_peers import Measurement
from benchmarks._contenders import STARTUP_TIMEOUT_S, Configuration
from benchmarks._procs import Peer, PeerError, expect, ignore_sigint, send_quietly, spawned

N_WORKERS = 2

#: A single-process cluster (``processes=False``): the zero-communication reference.
INPROC = "inproc"

#: ``answer(client, request)`` is what the child sends back for a request.
Answer = Callable[[Any, Any], Any]


def cluster_main(conn: Connection, scheme: str, answer: Answer) -> None:
    """Child: ``("ready", workers)`` once up, then one answer per request
    until EOF; ``("failed", traceback)`` if the cluster breaks."""
    from distributed import Client, LocalCluster

    ignore_sigint()
    kind = {"processes": False} if scheme == INPROC else {"protocol": scheme, "processes": True}
    try:
        with (LocalCluster(n_workers=N_WORKERS, threads_per_worker=1, dashboard_address=":0",
                           **kind) as cluster, Client(cluster) as client):
            client.wait_for_workers(N_WORKERS, timeout=STARTUP_TIMEOUT_S / 2)
            if scheme != INPROC:
                _check_same_backend(client, scheme)
            conn.send(("ready", workers(client)))
            while True:
                try:
                    request = conn.recv()  # idle: blocks, no CPU
                except (EOFError, OSError):
                    return
                conn.send(answer(client, request))
    except Exception:
        send_quietly(conn, ("failed", traceback.format_exc()))


def backend_file(scheme: str) -> str | None:
    from distributed.comm.registry import get_backend

    return sys.modules[type(get_backend(scheme)).__module__].__file__


def _check_same_backend(client: Any, scheme: str) -> None:
    """Workers (started by nannies) must run this process's build of the
    backend: a cluster mixing two builds would measure neither."""
    ours = backend_file(scheme)
    strays = {w: path for w, path in client.run(backend_file, scheme).items() if path != ours}
    if strays:
        raise RuntimeError(f"workers loaded the {scheme}:// backend from elsewhere than their "
                           f"cluster ({ours}): {strays}")


def workers(client: Any) -> list[str]:
    return sorted(client.nthreads())


def link_providers(client: Any) -> dict[str, list[str]]:
    """The lci providers the links of the scheduler's process and of each
    worker run over, asked on each one's event loop: what lci really used."""
    from dask_lcicomm import connections

    found = {"scheduler": client.run_on_scheduler(connections), **client.run(connections)}
    return {where: sorted({link["provider"] for link in links}) for where, links in found.items()}


def answer_idle(client: Any, request: str) -> tuple[str, Any]:
    return (request, link_providers(client) if request == "providers" else workers(client))


@contextmanager
def started_cluster(c: Configuration, answer: Answer) -> Iterator[tuple[Peer, list[str]]]:
    """The child running ``c``'s cluster and its workers, once all are up;
    it and its workers are stopped on exit in every case."""
    with spawned(cluster_main, c.scheme, answer, name=f"{c.label}-cluster",
                 dask_config=c.overrides, pythonpath=c.pythonpath,
                 daemon=False) as cluster:  # it starts worker processes
        yield cluster, expect(cluster, "ready", STARTUP_TIMEOUT_S)


def send_request(cluster: Peer, request: Any) -> None:
    """Ask the child something; a child that is gone is a :class:`PeerError`."""
    try:
        cluster.conn.send(request)
    except OSError as exc:
        raise PeerError(f"{cluster.process.name}: pipe broken ({exc})") from exc


def _ask(cluster: Peer, request: str, deadline: float) -> Any:
    send_request(cluster, request)
    return expect(cluster, request, deadline - time.monotonic())


def measure_idle(c: Configuration, settle_s: float, window_s: float, timeout_s: float
                 ) -> Measurement:
    """CPU seconds of ``c``'s whole idle cluster over ``window_s``, sampled
    every 0.5 s; an error if its workers changed meanwhile (a restart makes
    the number meaningless) or, with ``c.provider``, a link ran elsewhere."""
    with started_cluster(c, answer_idle) as (cluster, before):
        deadline = time.monotonic() + timeout_s
        time.sleep(settle_s)
        try:
            meter = TreeCpu(psutil.Process(cluster.process.pid))
        except psutil.NoSuchProcess as exc:
            raise PeerError(f"{cluster.process.name}: exited before the idle window") from exc
        while meter.sampled < meter.started + window_s:
            if not cluster.process.is_alive() or time.monotonic() > deadline:
                raise PeerError(f"{cluster.process.name}: exited or overran the idle window")
            time.sleep(max(0.0, min(0.5, meter.started + window_s - time.monotonic())))
            meter.sample()
        after = _ask(cluster, "workers", deadline)
        if after != before:
            raise PeerError(f"{cluster.process.name}: workers changed during the idle window "
                            f"({', '.join(before)} -> {', '.join(after)})")
        if c.provider is not None:
            found = _ask(cluster, "providers", deadline)
            if wrong := {where: used for where, used in found.items() if used != [c.provider]}:
                raise PeerError(f"{cluster.process.name}: links over providers {wrong}, not only "
                                f"{c.provider!r} (lci fell back; its log above says why)")
    return Measurement(meter.processes, meter.seconds, cpu_seconds=meter.cpu_seconds)


class TreeCpu:
    """CPU time (user + system) of a process tree between the first and the
    latest sample.  A process seen later counts from zero; one that vanished
    keeps its last sample (its parent's ``children_*`` times are not counted
    for anyone, so nothing counts twice)."""

    def __init__(self, root: psutil.Process) -> None:
        self._root = root
        self._first: dict[tuple[int, float], float] = {}
        self._latest: dict[tuple[int, float], float] = {}
        self.started = self.sampled = time.monotonic()
        self._record(baseline=True)

    def sample(self) -> None:
        self.sampled = time.monotonic()
        self._record(baseline=False)

    def _record(self, baseline: bool) -> None:
        try:
            tree = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            try:
                key = (proc.pid, proc.create_time())  # a recycled pid is a new process
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            self._first.setdefault(key, times.user + times.system if baseline else 0.0)
            self._latest[key] = times.user + times.system

    @property
    def processes(self) -> int:
        return len(self._latest)

    @property
    def seconds(self) -> float:
        return self.sampled - self.started

    @property
    def cpu_seconds(self) -> float:
        return sum(self._latest[key] - self._first[key] for key in self._latest)
