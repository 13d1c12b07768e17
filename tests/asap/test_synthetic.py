"""The synthetic logistic regression: deterministic data, a correct gradient,
a solver that reaches the optimum."""

from __future__ import annotations

import numpy as np
import pytest
from _gradients import assert_gradient_matches

from dask_lcicomm.asap.synthetic import SparseLogReg

SMALL = SparseLogReg(n_features=512, nworkers=3, samples_per_worker=200, n_test=300, nnz=8)


def test_data_is_deterministic_and_shards_differ():
    a, b = SparseLogReg(**vars(SMALL)), SMALL
    assert np.array_equal(a.shard(1).indices, b.shard(1).indices)
    assert not np.array_equal(SMALL.shard(0).indices, SMALL.shard(1).indices)
    assert SMALL.train_rows().labels.size == 600
    assert set(np.unique(SMALL.shard(0).labels)) == {-1.0, 1.0}


def test_model_message_is_hundreds_of_kb_by_default():
    assert SparseLogReg().init_model().nbytes >= 200_000


def test_gradient_matches_finite_differences():
    w = np.random.default_rng(0).normal(size=SMALL.n_features) * 0.1
    assert_gradient_matches(SMALL, w, SMALL.shard(0), coordinates=5)


def test_solver_reaches_a_stationary_point_below_sgd():
    w_star, f_star = SMALL.solve()
    assert np.linalg.norm(SMALL.gradient(w_star, SMALL.train_rows())) < 1e-4
    assert f_star < SMALL.loss(SMALL.init_model())
    w = SMALL.init_model()
    for r in range(50):
        w = SMALL.local_step(w, r % 3, r)
    assert f_star <= SMALL.loss(w)
    assert SMALL.accuracy(w_star) > 0.6


def test_local_step_is_seeded_and_leaves_its_input_alone():
    w = SMALL.init_model()
    a = SMALL.local_step(w, 1, 4)
    assert np.array_equal(a, SMALL.local_step(w, 1, 4))
    assert not np.array_equal(a, SMALL.local_step(w, 1, 5))
    assert not w.any()


def test_setup_checks_the_worker_count():
    with pytest.raises(ValueError):
        SMALL.setup(0, 4)
