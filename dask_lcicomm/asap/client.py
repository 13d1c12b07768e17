"""Train on a Dask cluster in one of the four modes: the user-facing call.

Models move worker-to-worker over the cluster's own comm scheme (``lci://``
by default in this package's examples, any scheme works); the scheduler only
places one long-running task per worker.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from distributed import Client, as_completed

from dask_lcicomm.asap.graphs import Graph, choose_graph
from dask_lcicomm.asap.modes import check_mode, effective_spectral_gap, mode_graph
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.report import RunReport, WorkerReport
from dask_lcicomm.asap.runtime import RunSpec, abort, install, open_links, train_task, uninstall
from dask_lcicomm.asap.task import Task

logger = logging.getLogger(__name__)


def train(
    client: Client,
    task: Task,
    *,
    mode: str = "asap",
    graph: Graph | None = None,
    max_degree: int = 2,
    rounds: int = 100,
    time_limit_s: float = 300.0,
    pacing: Pacing | None = None,
    record_every: int = 1,
    workers: Sequence[str] | None = None,
    start_delay_s: float = 2.0,
) -> RunReport:
    """Run ``rounds`` rounds of ``task`` on ``workers`` (default: all).

    ``graph`` is the sparse graph of ``async`` and ``asap`` (default: the
    best spectral gap with out-degree at most ``max_degree``); ``bsp`` and
    ``bsp-ring`` use their own. Every worker stops after ``rounds`` rounds or
    ``time_limit_s`` seconds from the common start, whichever comes first.
    """
    check_mode(mode)
    addresses = tuple(sorted(workers or client.scheduler_info(n_workers=-1)["workers"]))
    if graph is None:
        graph = choose_graph(len(addresses), max_degree)
    if graph.n != len(addresses):
        raise ValueError(f"graph {graph.name} has {graph.n} nodes for {len(addresses)} workers")
    exchanged_on = mode_graph(mode, graph)
    spec = RunSpec(f"asap-{uuid.uuid4().hex[:12]}", mode, exchanged_on, addresses, task,
                   rounds, time_limit_s, pacing or Pacing(), record_every)
    logger.info("run %s: mode %s on %s, %d workers", spec.run, mode, exchanged_on.name, len(addresses))
    client.run(install, spec, workers=list(addresses))
    try:
        client.run(open_links, spec.run, workers=list(addresses))
        start_at = time.time() + start_delay_s
        futures = [client.submit(train_task, spec.run, start_at, workers=[address], pure=False,
                                 allow_other_workers=False, key=f"{spec.run}-{rank}")
                   for rank, address in enumerate(addresses)]
        try:
            # the first failure stops the others at once instead of at their deadline
            for future in as_completed(futures, timeout=start_delay_s + time_limit_s + 120.0):
                if future.status == "error":
                    client.run(abort, spec.run, workers=list(addresses))
                    break
            raw = client.gather(futures)
        except BaseException:
            client.run(abort, spec.run, workers=list(addresses))
            client.cancel(futures)
            raise
    finally:
        client.run(uninstall, spec.run, workers=list(addresses))
    return RunReport(
        mode=mode, graph=exchanged_on.name if mode in ("async", "asap") else _baseline_name(mode),
        spectral_gap=effective_spectral_gap(mode, graph), diameter=exchanged_on.diameter,
        workers=[WorkerReport.from_dict(addresses[r["rank"]], r) for r in raw],
    )


def _baseline_name(mode: str) -> str:
    return "all-to-all" if mode == "bsp" else "ring-allreduce"
