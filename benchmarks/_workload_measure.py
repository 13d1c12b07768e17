"""What ``python -m benchmarks workloads`` measures around a workload's timed
part, from the process that holds the client.

* Wall time of the timed part.
* CPU time of the whole cluster: the client's process, the scheduler's, the
  workers' and the processes holding their nannies (user + system, and the
  system part alone).
* Minor page faults of those processes: memory touched for the first time
  since it was allocated or given back (a fresh receive buffer, a page of
  shared memory), which costs system time that no Python profile shows.
* Peak memory: the summed PSS of those processes, sampled every
  :data:`SAMPLE_S`; PSS splits a shared page among the processes that map it,
  so shared memory is counted once.
* The communication share: the seconds Dask's fine performance metrics
  attribute to communication, as a share of the wall time, in two parts.
  ``comm``: on the workers, ``gather-dep``'s network, deserialize and
  decompress time and the p2p extensions' background-comms send, serialize
  and compress time, summed over the workers and divided by their number.
  ``graph``: the scheduler's ``update-graph-duration``, the time from the
  client's graph arriving to its tasks being ready; it includes unpacking and
  materialising the graph, so it bounds the upload's cost from above.
  Transfers that overlap on one worker count each, so ``share`` (both parts)
  is capped at 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any

import psutil

from benchmarks._sampler import Sampler

SAMPLE_S = 0.1
_GATHER_DEP = frozenset({"network", "deserialize", "decompress"})
_P2P_COMMS = frozenset({"send", "serialize", "compress"})


@dataclass
class Measurement:
    seconds: float
    cpu_seconds: float
    system_seconds: float
    minor_faults: float
    peak_mib: float
    comm_seconds: float
    graph_seconds: float
    share: float

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def worker_comm_seconds(dask_worker: Any) -> float:
    """Run on a worker: its communication seconds so far (see the module)."""
    return sum(value for key, value in dask_worker.digests_total.items() if _is_comm(key))


def _is_comm(key: Any) -> bool:
    if not (isinstance(key, tuple) and len(key) >= 3 and key[-1] == "seconds"):
        return False
    if key[0] == "gather-dep":
        return key[1] in _GATHER_DEP
    return key[0] == "p2p" and len(key) == 5 and key[2] == "background-comms" \
        and key[3] in _P2P_COMMS


def scheduler_upload_seconds(dask_scheduler: Any) -> float:
    """Run on the scheduler: its seconds spent taking in graphs so far."""
    return float(dask_scheduler.digests_total.get("update-graph-duration", 0.0))


def cluster_pids(client: Any) -> set[int]:
    """This process, the scheduler's, the workers' and their parents (the
    nannies' processes; this one for a ``LocalCluster``)."""
    workers = set(client.run(os.getpid).values())
    pids = {os.getpid(), client.run_on_scheduler(os.getpid), *workers}
    for pid in workers:
        try:
            pids.add(psutil.Process(pid).ppid())
        except psutil.Error:
            pass
    return pids - {0, 1}


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _summed_pss(pids: set[int]) -> int:
    return sum(_pss_bytes(pid) for pid in pids)


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _counters(pids: set[int]) -> tuple[float, float, float]:
    """CPU seconds, system seconds and minor page faults, summed over ``pids``
    (one read of ``/proc/<pid>/stat`` each)."""
    cpu = system = faults = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                # The fields after the command's closing parenthesis: minflt is
                # the 8th, utime and stime the 12th and 13th (in clock ticks).
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, kernel = int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S
        cpu += user + kernel
        system += kernel
        faults += int(fields[7])
    return cpu, system, faults


class Meter:
    """Measures one timed part at a time on the cluster of ``client``."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pids = cluster_pids(client)
        self.last: Measurement | None = None

    def _comm_seconds(self) -> tuple[float, float]:
        """Mean seconds per worker in communication, and the scheduler's in graphs."""
        per_worker = self.client.run(worker_comm_seconds)
        graph = self.client.run_on_scheduler(scheduler_upload_seconds)
        return sum(per_worker.values()) / max(len(per_worker), 1), graph

    @contextmanager
    def timed(self) -> Iterator[None]:
        comm_before, graph_before = self._comm_seconds()
        before = _counters(self.pids)
        with Sampler(lambda: (_summed_pss(self.pids),), SAMPLE_S) as sampler:
            start = perf_counter()
            yield
            seconds = perf_counter() - start
        cpu, system, faults = (b - a for a, b in zip(before, _counters(self.pids), strict=True))
        comm, graph = self._comm_seconds()
        comm, graph = comm - comm_before, graph - graph_before
        self.last = Measurement(seconds, cpu, system, faults, sampler.peak()[0] / 2**20, comm,
                                graph, min(1.0, (comm + graph) / seconds) if seconds > 0 else 0.0)
