"""A ``LocalCluster`` (or a client of a cluster started elsewhere) in a child process that
answers the parent's requests (``dask`` runs graphs on it, ``workloads`` its workloads), and the
``idle`` benchmark: that process tree's idle CPU time."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

import psutil

from benchmarks._comm_peers import Measurement
from benchmarks._contenders import STARTUP_TIMEOUT_S, Configuration
from benchmarks._procs import Peer, PeerError, expect, receive, spawned

N_WORKERS = 2

#: A single-process cluster (``processes=False``): the zero-communication reference.
INPROC = "inproc"

Answer = Callable[[Any, Any], Any]  # answer(client, request): what the child sends back


def cluster_main(conn: Connection, scheme: str, answer: Answer, n_workers: int,
                 address: str | None, startup_s: float) -> None:
    """Child: a ``LocalCluster`` of ``n_workers`` single-threaded workers, or the cluster at
    ``address``; ``("ready", workers)``, then one answer per request until EOF."""
    from distributed import Client, LocalCluster

    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)  # a WARNING per P2P shuffle
    kind = {"processes": False} if scheme == INPROC else {"protocol": scheme, "processes": True}
    with ExitStack() as stack:
        client = stack.enter_context(Client(address or stack.enter_context(LocalCluster(
            n_workers=n_workers, threads_per_worker=1, dashboard_address=":0", **kind))))
        client.wait_for_workers(n_workers, timeout=startup_s)
        if scheme != INPROC:
            _check_same_backend(client, scheme)
        conn.send(("ready", workers(client)))
        while True:
            try:
                request = conn.recv()  # idle: blocks, no CPU
            except (EOFError, OSError):
                return
            conn.send(answer(client, request))


def backend_file(scheme: str) -> str | None:
    from distributed.comm.registry import get_backend

    return sys.modules[type(get_backend(scheme)).__module__].__file__


def _check_same_backend(client: Any, scheme: str) -> None:
    """Workers (started by nannies) must run our build: a mix of two would measure neither."""
    ours = backend_file(scheme)
    if strays := {w: path for w, path in client.run(backend_file, scheme).items() if path != ours}:
        raise RuntimeError(f"workers loaded the {scheme}:// backend from elsewhere than their "
                           f"cluster ({ours}): {strays}")


def workers(client: Any) -> list[str]:
    return sorted(client.nthreads())


def link_providers(client: Any) -> dict[str, list[str]]:
    """The providers lci's links really ran over, in the scheduler's process and each worker."""
    from dask_lcicomm import connections

    found = {"scheduler": client.run_on_scheduler(connections), **client.run(connections)}
    return {where: sorted({link["provider"] for link in links}) for where, links in found.items()}


def answer_idle(client: Any, providers: bool) -> tuple[str, Any]:
    """Its workers after the idle window and, if asked for, the providers of its links."""
    return ("idle", (workers(client), link_providers(client) if providers else None))


@contextmanager
def started_cluster(c: Configuration, answer: Answer, n_workers: int = N_WORKERS,
                    address: str | None = None, startup_s: float = STARTUP_TIMEOUT_S / 2
                    ) -> Iterator[tuple[Peer, list[str]]]:
    """The child running ``c``'s cluster and its workers, once all are up; stopped on exit."""
    with spawned(cluster_main, c.scheme, answer, n_workers, address, startup_s,
                 name=f"{c.label}-cluster", dask_config=c.overrides, pythonpath=c.pythonpath,
                 daemon=False) as cluster:  # it starts worker processes
        yield cluster, expect(cluster, "ready", startup_s + 30)


def cluster_answers(c: Configuration, answer: Answer, specs: Sequence[Any], **cluster: Any
                    ) -> Iterator[tuple[Any, Any]]:
    """Each spec with its answer from one fresh cluster child of ``c``, asked in turn."""
    with started_cluster(c, answer, **cluster) as (peer, _):
        for spec in specs:
            send_request(peer, spec)
            yield spec, receive(peer, spec.timeout_s)


def send_request(cluster: Peer, request: Any) -> None:
    """Ask the child something; a child that is gone is a :class:`PeerError`."""
    try:
        cluster.conn.send(request)
    except OSError as exc:
        raise PeerError(f"{cluster.process.name}: pipe broken ({exc})") from exc


def measure_idle(c: Configuration, settle_s: float, window_s: float, timeout_s: float
                 ) -> Measurement:
    """CPU seconds of ``c``'s whole idle cluster over ``window_s``: an error if its workers
    changed meanwhile (a restart) or, with ``c.provider``, a link ran over another provider."""
    with started_cluster(c, answer_idle) as (cluster, before):
        deadline = time.monotonic() + timeout_s
        time.sleep(settle_s)
        try:
            root = psutil.Process(cluster.process.pid)
        except psutil.NoSuchProcess as exc:
            raise PeerError(f"{cluster.process.name}: exited before the idle window") from exc
        first = latest = _tree_cpu(root)
        started = sampled = time.monotonic()
        while sampled < started + window_s:
            if not cluster.process.is_alive() or time.monotonic() > deadline:
                raise PeerError(f"{cluster.process.name}: exited or overran the idle window")
            time.sleep(max(0.0, min(0.5, started + window_s - time.monotonic())))
            sampled = time.monotonic()
            latest = latest | _tree_cpu(root)
        send_request(cluster, c.provider is not None)
        after, found = expect(cluster, "idle", deadline - time.monotonic())
    if after != before:
        raise PeerError(f"{cluster.process.name}: workers changed during the idle window "
                        f"({', '.join(before)} -> {', '.join(after)})")
    if wrong := {at: used for at, used in (found or {}).items() if used != [c.provider]}:
        raise PeerError(f"{cluster.process.name}: links over providers {wrong}, not only "
                        f"{c.provider!r} (lci fell back; its log above says why)")
    cpu_seconds = sum(seconds - first.get(key, 0.0) for key, seconds in latest.items())
    return Measurement(len(latest), sampled - started, cpu_seconds=cpu_seconds)


def _tree_cpu(root: psutil.Process) -> dict[tuple[int, float], float]:
    """User + system CPU seconds of each process in ``root``'s tree, by pid and start time:
    merged over samples, one that exits keeps its last (``children_*`` times never count)."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found: dict[tuple[int, float], float] = {}
    for proc in tree:
        with suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = proc.cpu_times()
            found[proc.pid, proc.create_time()] = times.user + times.system
    return found
