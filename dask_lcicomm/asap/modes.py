"""The four modes behind one API, and what graph each one uses.

==========  =============================================  ====================
mode        exchange                                       graph
==========  =============================================  ====================
bsp         all-to-all averaging (the barrier is implied)  all-to-all
bsp-ring    ring all-reduce, bandwidth-optimal             ring
async       send and reduce whatever arrived, no waiting   the sparse graph
asap        stochastic reduce under NOTIFY-ACK             the sparse graph
==========  =============================================  ====================
"""

from __future__ import annotations

from dask_lcicomm.asap.bsp import AllToAll
from dask_lcicomm.asap.gossip import Gossip
from dask_lcicomm.asap.graphs import Graph, all_to_all, ring
from dask_lcicomm.asap.notify_ack import NotifyAck
from dask_lcicomm.asap.protocol import Exchange
from dask_lcicomm.asap.ring import RingAllReduce

MODES = ("bsp", "bsp-ring", "async", "asap")


def mode_graph(mode: str, sparse: Graph) -> Graph:
    """The graph ``mode`` exchanges models on, for ``sparse.n`` workers."""
    check_mode(mode)
    if mode == "bsp":
        return all_to_all(sparse.n)
    if mode == "bsp-ring":
        return ring(sparse.n)
    return sparse


def effective_spectral_gap(mode: str, sparse: Graph) -> float:
    """How much one round's reduce mixes: 1 for the exact all-reduces."""
    return 1.0 if mode in ("bsp", "bsp-ring") else sparse.spectral_gap


def make_exchange(mode: str, graph: Graph, rank: int) -> Exchange:
    """Rank ``rank``'s exchange state machine for ``mode`` on ``graph``
    (the graph returned by :func:`mode_graph`)."""
    check_mode(mode)
    if mode == "bsp":
        return AllToAll(graph.out[rank])
    if mode == "bsp-ring":
        return RingAllReduce(rank, graph.n)
    if mode == "async":
        return Gossip(graph.out[rank], graph.inn[rank])
    return NotifyAck(graph.out[rank], graph.inn[rank])


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
