"""A ``LocalCluster`` (plus ``Client``) kept up in a child process, answering
the parent's requests.

Used by ``idle`` (which measures the CPU time of that process tree from
outside) and by ``dask`` (which has real graphs run on it).  The cluster lives
in a ``spawn``-ed child for the same reasons every peer does (see
:mod:`benchmarks._procs`): a fresh backend per round, and a cluster that hangs
or crashes is torn down with its workers instead of taking the harness along.

The child speaks a tiny protocol over its pipe: ``("ready", workers)`` once
the cluster is up, then one answer per request, computed by the ``answer``
function the parent chose, until the parent closes the pipe;
``("failed", traceback)`` if the cluster itself breaks.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from benchmarks._procs import (
    Peer,
    PeerError,
    expect,
    ignore_sigint,
    send_quietly,
    spawned,
)

N_WORKERS = 2

#: The "scheme" of a single-process cluster (``processes=False``): workers are
#: threads of the child and data is handed over without serialization.
INPROC = "inproc"

#: What the child does with one request: ``answer(client, request)`` is sent back.
Answer = Callable[[Any, Any], Any]


# ---------------------------------------------------------------------- child


def cluster_main(
    conn: Connection, scheme: str, n_workers: int, timeout_s: float, answer: Answer
) -> None:
    """Process entry point: keep a cluster up, ``answer`` each request.

    ``answer`` must be a module-level function: it is pickled into the child.
    """
    ignore_sigint()
    try:
        _serve_cluster(conn, scheme, n_workers, timeout_s, answer)
    except Exception:
        send_quietly(conn, ("failed", traceback.format_exc()))


def _serve_cluster(
    conn: Connection, scheme: str, n_workers: int, timeout_s: float, answer: Answer
) -> None:
    from distributed import Client

    with _local_cluster(scheme, n_workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(n_workers, timeout=timeout_s)
        if scheme != INPROC:
            _check_same_backend(client, scheme)
        conn.send(("ready", workers(client)))
        while (request := _next_request(conn)) is not None:
            conn.send(answer(client, request))


def _local_cluster(scheme: str, n_workers: int) -> Any:
    """One worker process per worker, speaking ``scheme``; or, for
    :data:`INPROC`, worker threads in this process (the zero-communication
    reference: no comm, no serialization)."""
    from distributed import LocalCluster

    common = {"n_workers": n_workers, "threads_per_worker": 1, "dashboard_address": ":0"}
    if scheme == INPROC:
        return LocalCluster(processes=False, **common)
    return LocalCluster(protocol=scheme, processes=True, **common)


def backend_file(scheme: str) -> str | None:
    """Where this process loaded the comm backend of ``scheme`` from."""
    from distributed.comm.registry import get_backend

    return sys.modules[type(get_backend(scheme)).__module__].__file__


def _check_same_backend(client: Any, scheme: str) -> None:
    """The workers, started by nannies in processes of their own, run the
    very build of the backend that this process (scheduler and client) runs:
    a cluster mixing two builds (e.g. ``lci@baseline`` workers that found the
    current checkout first) would measure neither."""
    ours = backend_file(scheme)
    strays = {worker: path for worker, path in client.run(backend_file, scheme).items()
              if path != ours}
    if strays:
        raise RuntimeError(f"workers loaded the {scheme}:// backend from elsewhere than their "
                           f"cluster ({ours}): {strays}")


def workers(client: Any) -> list[str]:
    """Worker addresses as the scheduler sees them, asked over the comm itself."""
    return sorted(client.nthreads())


def link_providers(client: Any) -> dict[str, list[str]]:
    """The lci providers that the links of the scheduler's process and of
    each worker run over, asked on each one's own event loop (lci keeps its
    links per loop), by process: what an lci cluster really ran on."""
    from dask_lcicomm import connections

    found = {"scheduler": client.run_on_scheduler(connections), **client.run(connections)}
    return {where: sorted({link["provider"] for link in links}) for where, links in found.items()}


def _next_request(conn: Connection) -> Any:
    """Block (idle: no CPU) until the parent asks something; None on EOF."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


# --------------------------------------------------------------------- parent


@contextmanager
def started_cluster(
    scheme: str,
    answer: Answer,
    startup_timeout_s: float,
    label: str | None = None,
    dask_config: Mapping[str, Any] | None = None,
    pythonpath: str | None = None,
) -> Iterator[tuple[Peer, list[str]]]:
    """The child running the cluster, and its workers once they are all up.

    ``dask_config`` reaches every process of the cluster, and so does
    ``pythonpath`` (searched first for modules, see
    :func:`~benchmarks._procs.spawned`); the workers are checked to run the
    child's build of the backend.  ``label`` names the child in errors
    (default: the scheme).  Raises
    :class:`~benchmarks._procs.PeerError` if the cluster does not come up
    within ``startup_timeout_s``; the child and its workers are stopped on
    exit in every case.
    """
    with spawned(
        cluster_main, scheme, N_WORKERS, startup_timeout_s / 2, answer,  # child times out first
        name=f"{label or scheme}-cluster", dask_config=dask_config, pythonpath=pythonpath,
        daemon=False,  # it starts worker processes
    ) as cluster:
        yield cluster, expect(cluster, "ready", startup_timeout_s)


def send_request(cluster: Peer, request: Any) -> None:
    """Ask the child something; a child that is gone is a :class:`PeerError`."""
    try:
        cluster.conn.send(request)
    except OSError as exc:
        raise PeerError(f"{cluster.process.name}: pipe broken ({exc})") from exc
