"""Graphs: constructions, mixing matrices, spectral gaps and diameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dask_lcicomm.asap.graphs import (
    Graph,
    all_to_all,
    candidates,
    choose_graph,
    circulant,
    exponential,
    halton,
    random_regular,
    ring,
    spectral_gap,
)


def test_all_to_all_mixes_in_one_round():
    g = all_to_all(6)
    assert g.degree == 5 and g.diameter == 1
    assert g.spectral_gap == pytest.approx(1.0)
    assert np.allclose(g.mixing_matrix(), np.full((6, 6), 1 / 6))


@pytest.mark.parametrize("n", [3, 8, 16])
def test_directed_ring_gap_matches_theory(n):
    # W = (I + P)/2, eigenvalues (1 + e^{2 pi i k/n})/2, |lambda_2| = cos(pi/n)
    g = ring(n)
    assert g.spectral_gap == pytest.approx(1 - math.cos(math.pi / n))
    assert g.diameter == n - 1


def test_disconnected_graph_has_no_gap_and_infinite_diameter():
    g = circulant(8, [4])  # pairs
    assert g.spectral_gap == pytest.approx(0.0, abs=1e-12)
    assert g.diameter == math.inf


def test_halton_base_2_at_16_nodes_does_not_mix():
    """Its offsets 8, 4, 12, 2 all share the factor 2 with 16: the construction
    looks spread out, the numbers show it is disconnected."""
    for d in (1, 2, 3, 4):
        g = halton(16, d)
        assert g.spectral_gap < 1e-9 and g.diameter == math.inf, g.name
        assert choose_graph(16, d).spectral_gap > 0.01


def test_nearly_bipartite_circulant_has_small_gap():
    # all offsets odd on an even ring: eigenvalue (1 - d)/(d + 1) at k = n/2
    g = circulant(16, [1, 3, 5, 7, 9])
    assert g.spectral_gap == pytest.approx(1 - 4 / 6, abs=1e-9)


@pytest.mark.parametrize("n,d", [(8, 1), (8, 2), (8, 3), (16, 2), (16, 4), (13, 3)])
def test_every_candidate_is_regular_and_doubly_stochastic(n, d):
    for g in candidates(n, d):
        assert g.degree <= d
        assert [len(p) for p in g.inn] == [len(p) for p in g.out], g.name
        w = g.mixing_matrix()
        assert np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1), g.name


@pytest.mark.parametrize("n,d", [(8, 2), (8, 3), (16, 3), (32, 4)])
def test_choose_graph_keeps_the_best_gap_within_the_budget(n, d):
    chosen = choose_graph(n, d)
    assert chosen.degree <= d
    assert chosen.spectral_gap == pytest.approx(max(g.spectral_gap for g in candidates(n, d)))
    assert chosen.diameter < math.inf


def test_choose_graph_with_a_full_budget_is_all_to_all():
    assert choose_graph(5, 4).name == "all-to-all"


def test_exponential_offsets_and_diameter():
    g = exponential(16, 4)
    assert g.out[0] == (1, 2, 4, 8)
    assert g.diameter == 4


def test_random_regular_is_seeded_and_simple():
    a, b = random_regular(12, 3, seed=5), random_regular(12, 3, seed=5)
    assert a == b
    for i, peers in enumerate(a.out):
        assert len(set(peers)) == 3 and i not in peers


def test_graph_rejects_self_loops_and_bad_ranks():
    with pytest.raises(ValueError):
        Graph("bad", ((0,), (0,)))
    with pytest.raises(ValueError):
        Graph("bad", ((2,), (0,)))


def test_spectral_gap_of_a_single_node():
    assert spectral_gap(np.ones((1, 1))) == 1.0
