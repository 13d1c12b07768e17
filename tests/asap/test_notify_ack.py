"""NOTIFY-ACK: the state machine step by step, then its invariants under
random delays (no deadlock, iteration gap within the graph's diameter)."""

from __future__ import annotations

import numpy as np
import pytest

from dask_lcicomm.asap.graphs import choose_graph, circulant, exponential, random_regular, ring
from dask_lcicomm.asap.modes import make_exchange
from dask_lcicomm.asap.notify_ack import NotifyAck
from dask_lcicomm.asap.protocol import Kind, Message, Reduced, Send
from dask_lcicomm.asap.simulate import simulate

ONE = np.ones(2)


def sends(actions, kind=None):
    return [(a.dst, a.message.kind, a.message.round) for a in actions
            if isinstance(a, Send) and (kind is None or a.message.kind is kind)]


def reduced(actions):
    return [a for a in actions if isinstance(a, Reduced)]


def test_first_round_notifies_then_reduces_when_every_in_neighbour_notified():
    m = NotifyAck(out_peers=[1, 2], in_peers=[3, 4])
    assert sends(m.start_round(0, ONE)) == [(1, Kind.NOTIFY, 0), (2, Kind.NOTIFY, 0)]
    assert m.receive(3, Message(Kind.NOTIFY, 0, 2 * ONE)) == []
    actions = m.receive(4, Message(Kind.NOTIFY, 0, 3 * ONE))
    assert sends(actions) == [(3, Kind.ACK, 0), (4, Kind.ACK, 0)]
    [done] = reduced(actions)
    assert done.round == 0 and np.allclose(done.model, 2.0)


def test_next_notify_waits_for_every_ack_and_so_does_the_reduce():
    m = NotifyAck(out_peers=[1, 2], in_peers=[1])
    m.start_round(0, ONE)
    m.receive(1, Message(Kind.NOTIFY, 0, ONE))
    # round 1: early in-neighbour NOTIFY, but out-neighbours have not ACKed 0
    assert m.receive(1, Message(Kind.NOTIFY, 1, ONE)) == []
    assert m.start_round(1, ONE) == []
    assert m.receive(1, Message(Kind.ACK, 0)) == []
    actions = m.receive(2, Message(Kind.ACK, 0))
    assert sends(actions, Kind.NOTIFY) == [(1, Kind.NOTIFY, 1), (2, Kind.NOTIFY, 1)]
    assert [r.round for r in reduced(actions)] == [1]


@pytest.mark.parametrize("bad", [
    (5, Message(Kind.ACK, 0)),  # not an out-neighbour
    (1, Message(Kind.ACK, 3)),  # wrong round
    (9, Message(Kind.NOTIFY, 0, ONE)),  # not an in-neighbour
    (2, Message(Kind.NOTIFY, 0)),  # no model
    (2, Message(Kind.CHUNK, 0, ONE)),
])
def test_protocol_violations_raise(bad):
    m = NotifyAck(out_peers=[1], in_peers=[2])
    m.start_round(0, ONE)
    with pytest.raises(RuntimeError):
        m.receive(*bad)


def test_start_round_out_of_order_raises():
    m = NotifyAck(out_peers=[1], in_peers=[1])
    with pytest.raises(RuntimeError):
        m.start_round(1, ONE)


GRAPHS = [ring(5), circulant(8, [1, 3]), exponential(16, 3), random_regular(12, 2, seed=1),
          choose_graph(8, 2), circulant(9, [2])]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{g.name}-n{g.n}")
@pytest.mark.parametrize("fifo", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_no_deadlock_and_gap_within_diameter_under_random_delays(graph, fifo, seed):
    if graph.diameter == float("inf"):
        pytest.fail(f"test graph {graph.name} is not strongly connected")
    rng = np.random.default_rng(seed)
    rounds = 40
    result = simulate(
        [make_exchange("asap", graph, r) for r in range(graph.n)],
        [np.full(3, float(r)) for r in range(graph.n)], rounds,
        compute_time=lambda rank, rnd: rng.exponential(1.0) * (6.0 if rng.random() < 0.1 else 1.0),
        delay=lambda src, dst, m: rng.exponential(0.5) + (5.0 if rng.random() < 0.05 else 0.0),
        fifo=fifo, max_events=200_000,
    )
    assert result.finished, f"deadlock: rounds completed {result.rounds}"
    assert result.max_gap <= graph.diameter
    assert result.max_staleness == 0
    # per round: d NOTIFYs and d ACKs per worker
    assert result.messages == rounds * 2 * sum(len(p) for p in graph.out)


def test_gap_bound_is_reached_on_a_long_cycle():
    """The bound is not loose: a slow worker on a directed ring lets the
    others run ahead, up to the ring's diameter at most."""
    graph = ring(6)
    result = simulate(
        [make_exchange("asap", graph, r) for r in range(6)], [np.zeros(1)] * 6, 30,
        compute_time=lambda rank, rnd: 50.0 if rank == 0 else 0.01,
        delay=lambda src, dst, m: 0.01,
    )
    assert result.finished
    assert 2 <= result.max_gap <= graph.diameter
