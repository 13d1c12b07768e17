"""ASAP on Dask workers: stochastic reduce under NOTIFY-ACK, next to BSP
all-reduce (all-to-all and ring) and plain async, on one API.

Workers exchange models with each other over the cluster's comm scheme,
never through the scheduler::

    from dask_lcicomm.asap import SparseLogReg, train

    report = train(client, SparseLogReg(nworkers=8), mode="asap", rounds=200)

The algorithmic core (graphs, the per-worker exchange state machines, the
reduce rule, a discrete-event simulator) is pure and works without Dask; the
Dask layer (:mod:`~dask_lcicomm.asap.runtime`, :mod:`~dask_lcicomm.asap.links`,
:mod:`~dask_lcicomm.asap.client`) only moves messages and keeps time.
"""

from dask_lcicomm.asap.client import train
from dask_lcicomm.asap.graphs import (
    Graph,
    all_to_all,
    choose_graph,
    circulant,
    exponential,
    halton,
    random_regular,
    ring,
)
from dask_lcicomm.asap.mlp import MLP
from dask_lcicomm.asap.modes import MODES
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.report import RunReport, WorkerReport
from dask_lcicomm.asap.simulate import simulate
from dask_lcicomm.asap.synthetic import SparseLogReg
from dask_lcicomm.asap.task import Task

__all__ = [
    "MLP", "MODES", "Graph", "Pacing", "RunReport", "SparseLogReg", "Task", "WorkerReport",
    "all_to_all", "choose_graph", "circulant", "exponential", "halton", "random_regular", "ring",
    "simulate", "train",
]
