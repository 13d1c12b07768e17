"""The ``idle`` benchmark: CPU time burnt by a small Dask cluster doing nothing.

A comm backend can win every throughput benchmark by busy-polling its network
and still be a bad citizen on a shared node, where an idle cluster should cost
next to nothing.  So this benchmark starts a real ``LocalCluster`` (scheduler,
client and nannies in one child process, one process per worker below it) on
the scheme under test, waits until it is quiet, and measures the CPU time of
that whole process tree over an idle window.

The measuring happens in the parent, from outside the tree, so that it is not
counted itself; the child just keeps the cluster up until told to stop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from time import monotonic
from typing import Any

import psutil

from benchmarks._cluster import N_WORKERS, link_providers, send_request, started_cluster, workers
from benchmarks._comm_peers import BenchSpec, Measurement
from benchmarks._procs import Peer, PeerError, expect

__all__ = ["IDLE_KIND", "N_WORKERS", "measure_idle", "TreeCpu"]

IDLE_KIND = "idle"

#: Seconds between samples of the process tree.  A process that exits during
#: the window loses at most this much of its CPU time (see :class:`TreeCpu`).
SAMPLE_INTERVAL_S = 0.5


# ---------------------------------------------------------------------- child


def answer_idle(client: Any, request: str) -> tuple[str, Any]:
    """The child's answers: which workers are connected right now, or over
    which lci providers the cluster's links run (see :func:`link_providers`)."""
    if request == "providers":
        return ("providers", link_providers(client))
    return ("workers", workers(client))


# --------------------------------------------------------------------- parent


def measure_idle(
    scheme: str,
    spec: BenchSpec,
    startup_timeout_s: float,
    dask_config: Mapping[str, Any] | None = None,
    label: str | None = None,
    pythonpath: str | None = None,
    provider: str | None = None,
) -> Measurement:
    """Start a cluster on ``scheme``, let it settle, measure its idle CPU time.

    ``dask_config`` reaches every process of the cluster (a configuration
    variant), and so does ``pythonpath`` (another build: modules found there
    first); ``label`` names the child process in errors (default: scheme).
    With ``provider``, every lci link of the cluster must have run over it
    (asked after the window, so that asking costs the window nothing).

    Bounded in wall time by ``startup_timeout_s + spec.timeout_s`` plus the
    teardown of :func:`benchmarks._procs.spawned`, which also stops the
    cluster's processes if the child cannot.  Raises :class:`PeerError` if the
    cluster fails, or if its workers changed during the window (a reconnect or
    restart would make the CPU time meaningless), or if a link ran over
    another provider (the CPU time would be the fallback's).
    """
    with started_cluster(
        scheme, answer_idle, startup_timeout_s, label=label, dask_config=dask_config,
        pythonpath=pythonpath,
    ) as (cluster, workers_before):
        deadline = monotonic() + spec.timeout_s
        time.sleep(spec.settle_s)
        measurement = _measure_tree(cluster, spec.duration_s, deadline)
        after = _ask_workers(cluster, deadline)
        if after != workers_before:
            raise PeerError(
                f"{cluster.process.name}: workers changed during the idle window "
                f"({', '.join(workers_before)} -> {', '.join(after)})"
            )
        if provider is not None:
            _check_providers(cluster, provider, deadline)
    return measurement


def _ask_workers(cluster: Peer, deadline: float) -> list[str]:
    send_request(cluster, "workers")
    return expect(cluster, "workers", deadline - monotonic())


def _check_providers(cluster: Peer, provider: str, deadline: float) -> None:
    send_request(cluster, "providers")
    found = expect(cluster, "providers", deadline - monotonic())
    wrong = {where: used for where, used in found.items() if used != [provider]}
    if wrong:
        raise PeerError(f"{cluster.process.name}: links over providers {wrong}, not only "
                        f"{provider!r} (lci fell back; its log above says why)")


def _measure_tree(cluster: Peer, window_s: float, deadline: float) -> Measurement:
    """Sample the child's process tree every :data:`SAMPLE_INTERVAL_S` over
    ``window_s``; the cluster must stay up throughout."""
    try:
        meter = TreeCpu(psutil.Process(cluster.process.pid))
    except psutil.NoSuchProcess as exc:
        raise PeerError(f"{cluster.process.name}: exited before the idle window") from exc
    end = meter.started + window_s
    while True:
        _check_up(cluster, deadline)
        if meter.sampled >= end:
            break
        time.sleep(max(0.0, min(SAMPLE_INTERVAL_S, end - monotonic())))
        meter.sample()
    return Measurement(meter.processes, meter.seconds, cpu_seconds=meter.cpu_seconds)


def _check_up(cluster: Peer, deadline: float) -> None:
    if not cluster.process.is_alive():
        raise PeerError(f"{cluster.process.name}: exited during the idle window")
    if monotonic() > deadline:
        raise PeerError(f"{cluster.process.name}: sampling overran the idle window")


_Key = tuple[int, float]  # (pid, creation time): a recycled pid is a new process


class TreeCpu:
    """CPU time (user + system) of a process and all its descendants since
    construction (the first sample) up to the latest :meth:`sample`.

    A process first seen after the first sample counts from zero: all of its
    CPU time falls into the window.  One that disappears keeps its last sampled
    value, losing at most one sample interval -- a dead process can no longer
    be asked, and its parent's ``children_*`` times cannot be attributed (nor
    are they counted for anyone, so nothing is counted twice).
    """

    def __init__(self, root: psutil.Process) -> None:
        self._root = root
        self._first: dict[_Key, float] = {}
        self._latest: dict[_Key, float] = {}
        self.started = self.sampled = monotonic()
        self._record(baseline=True)

    def sample(self) -> None:
        self.sampled = monotonic()
        self._record(baseline=False)

    def _record(self, baseline: bool) -> None:
        for proc in self._tree():
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # gone since listed: its last sample stands
            cpu = times.user + times.system
            self._first.setdefault(key, cpu if baseline else 0.0)
            self._latest[key] = cpu

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    @property
    def processes(self) -> int:
        """How many processes were seen at all."""
        return len(self._latest)

    @property
    def seconds(self) -> float:
        """Wall time between the first and the latest sample."""
        return self.sampled - self.started

    @property
    def cpu_seconds(self) -> float:
        return sum(self._latest[key] - self._first[key] for key in self._latest)
