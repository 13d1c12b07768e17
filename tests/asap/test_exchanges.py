"""bsp, bsp-ring and async exchanges, and every mode's convergence: the exact
all-reduces average in one round, asap reaches the same average, async does not."""

from __future__ import annotations

import numpy as np
import pytest

from dask_lcicomm.asap.gossip import Gossip
from dask_lcicomm.asap.graphs import choose_graph, ring
from dask_lcicomm.asap.modes import MODES, effective_spectral_gap, make_exchange, mode_graph
from dask_lcicomm.asap.protocol import Kind, Message, Reduced, Send
from dask_lcicomm.asap.ring import RingAllReduce
from dask_lcicomm.asap.simulate import simulate


def run(mode, n, models, rounds, seed=0, step=None, graph=None):
    rng = np.random.default_rng(seed)
    sparse = graph or choose_graph(n, 2)
    g = mode_graph(mode, sparse)
    return simulate([make_exchange(mode, g, r) for r in range(n)], models, rounds, step=step,
                    compute_time=lambda rank, rnd: rng.exponential(1.0),
                    delay=lambda src, dst, m: rng.exponential(0.3), max_events=500_000)


@pytest.mark.parametrize("mode", ["bsp", "bsp-ring"])
@pytest.mark.parametrize("n,size", [(1, 5), (2, 1), (3, 7), (5, 3), (8, 1000)])
def test_exact_all_reduce_in_one_round(mode, n, size):
    rng = np.random.default_rng(n)
    models = [rng.normal(size=size) for _ in range(n)]
    result = run(mode, n, models, 1, graph=ring(n) if n < 3 else None)
    assert result.finished and result.max_gap <= 1
    for model in result.models:
        assert np.allclose(model, np.mean(models, axis=0))


def test_ring_sends_two_n_minus_one_chunks_per_round():
    n = 6
    result = run("bsp-ring", n, [np.arange(12.0)] * n, 3)
    assert result.messages == 3 * n * 2 * (n - 1)


def test_ring_keeps_chunks_of_a_fast_predecessor():
    r = RingAllReduce(rank=1, n=3)
    early = Message(Kind.CHUNK, 0, np.array([10.0]), step=0)
    assert r.receive(0, early) == []
    actions = r.start_round(0, np.arange(3.0))
    assert [a.message.step for a in actions if isinstance(a, Send)] == [0, 1]
    with pytest.raises(RuntimeError):
        r.receive(2, Message(Kind.CHUNK, 0, np.array([1.0]), step=1))


def test_asap_converges_to_the_all_reduce_average():
    n = 8
    rng = np.random.default_rng(7)
    models = [rng.normal(size=50) for _ in range(n)]
    mean = np.mean(models, axis=0)
    result = run("asap", n, models, 60)
    assert result.finished
    spread0 = max(np.abs(m - mean).max() for m in models)
    error = max(np.abs(m - mean).max() for m in result.models)
    gap = choose_graph(n, 2).spectral_gap
    assert error <= spread0 * (1 - gap) ** 30  # geometric, at the graph's rate
    assert np.allclose(np.mean(result.models, axis=0), mean)  # the mean is preserved


def test_async_does_not_preserve_the_average():
    n = 8
    rng = np.random.default_rng(3)
    models = [rng.normal(size=20) for _ in range(n)]
    result = simulate([make_exchange("async", choose_graph(n, 2), r) for r in range(n)], models, 20,
                      compute_time=lambda rank, rnd: 5.0 if rank == 0 else rng.exponential(1.0),
                      delay=lambda src, dst, m: rng.exponential(0.3))
    assert result.finished and result.max_gap > choose_graph(n, 2).diameter
    assert not np.allclose(np.mean(result.models, axis=0), np.mean(models, axis=0))


def test_sgd_with_asap_reaches_the_all_reduce_solution():
    """Least squares split over 8 workers: the all-reduces run full gradient
    descent and reach the solution; asap with a constant step ends within a
    small, step-size dependent distance of it (the known bias of
    decentralised gradient descent), far from where it started."""
    n, dim = 8, 5
    rng = np.random.default_rng(11)
    a = [rng.normal(size=(20, dim)) for _ in range(n)]
    x_true = rng.normal(size=dim)
    b = [ai @ x_true + 0.01 * rng.normal(size=20) for ai in a]
    solution = np.linalg.lstsq(np.vstack(a), np.concatenate(b), rcond=None)[0]

    def step(rank, rnd, x):
        return x - 0.02 * a[rank].T @ (a[rank] @ x - b[rank])

    finals = {mode: run(mode, n, [np.zeros(dim)] * n, 300, step=step).models for mode in MODES}
    for mode in ("bsp", "bsp-ring"):
        for x in finals[mode]:
            assert np.allclose(x, solution, atol=1e-6), mode
    for x in finals["asap"]:
        assert np.linalg.norm(x - solution) <= 0.005 * np.linalg.norm(solution)
    assert np.allclose(finals["bsp"], finals["bsp-ring"])


def test_gossip_reduces_the_newest_arrival_once_and_sends_latest_only():
    g = Gossip(out_peers=[1], in_peers=[2, 3])
    g.receive(2, Message(Kind.NOTIFY, 0, np.array([2.0])))
    g.receive(2, Message(Kind.NOTIFY, 2, np.array([8.0])))
    g.receive(2, Message(Kind.NOTIFY, 1, np.array([5.0])))  # older, out of order: ignored
    actions = g.start_round(4, np.array([0.0]))
    [send] = [a for a in actions if isinstance(a, Send)]
    [done] = [a for a in actions if isinstance(a, Reduced)]
    assert send.latest_only and send.dst == 1
    assert np.allclose(done.model, [4.0]) and done.staleness == 2
    [again] = [a for a in g.start_round(5, np.array([1.0])) if isinstance(a, Reduced)]
    assert np.allclose(again.model, [1.0])


def test_modes_and_their_graphs():
    sparse = choose_graph(8, 2)
    assert mode_graph("bsp", sparse).name == "all-to-all"
    assert mode_graph("bsp-ring", sparse).name == "ring"
    assert mode_graph("asap", sparse) is sparse is mode_graph("async", sparse)
    assert effective_spectral_gap("bsp-ring", sparse) == 1.0
    assert effective_spectral_gap("asap", sparse) == sparse.spectral_gap
    with pytest.raises(ValueError):
        make_exchange("bulk", sparse, 0)
