"""The multi-layer perceptron: deterministic data, a correct gradient, a
reference that trains, and a non-convex loss."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from _gradients import assert_gradient_matches

from dask_lcicomm.asap.mlp import MLP

SMALL = MLP(inputs=6, hidden=16, classes=3, nworkers=3, samples_per_worker=300, n_test=300,
            eval_samples_total=150)


def test_data_is_deterministic_and_shards_differ():
    again = MLP(**vars(SMALL))
    assert np.array_equal(again.shard(1).x, SMALL.shard(1).x)
    assert not np.array_equal(SMALL.shard(0).x, SMALL.shard(1).x)
    assert set(np.unique(SMALL.shard(0).y)) == {0, 1, 2}
    assert SMALL.eval_samples().y.size == 150


def test_every_worker_starts_from_the_same_model_of_hundreds_of_kb():
    assert np.array_equal(SMALL.init_model(), MLP(**vars(SMALL)).init_model())
    model = MLP().init_model()
    assert model.size == MLP().n_params and 200_000 <= model.nbytes <= 800_000


def test_gradient_matches_finite_differences():
    model = SMALL.init_model() + 0.1 * np.random.default_rng(0).normal(size=SMALL.n_params)
    assert_gradient_matches(SMALL, model, SMALL.shard(0).take(np.arange(40)), coordinates=12)


def test_sgd_and_the_reference_lower_the_loss_and_raise_accuracy():
    model = start = SMALL.init_model()
    for r in range(300):
        model = SMALL.local_step(model, r % 3, r)
    assert SMALL.loss(model) < 0.8 * SMALL.loss(start)
    reference, f_ref = SMALL.solve(steps=300, batch=64)
    assert f_ref == SMALL.loss(reference) < SMALL.loss(start)
    assert SMALL.accuracy(reference) > 1 / SMALL.classes + 0.2


def test_the_loss_is_not_convex():
    """Permuting hidden units leaves the loss unchanged, yet the midpoint of a
    model and its permutation is worse: no convex function does that."""
    reference, f_ref = SMALL.solve(steps=300, batch=64)
    i, h, c = SMALL.inputs, SMALL.hidden, SMALL.classes
    w1, b1, w2, b2 = (part.copy() for part in SMALL._unpack(reference))
    perm = np.roll(np.arange(h), 1)
    permuted = np.concatenate([w1[:, perm].ravel(), b1[perm], w2[perm].ravel(), b2])
    assert SMALL.loss(permuted) == pytest.approx(f_ref)
    assert SMALL.loss((reference + permuted) / 2) > f_ref + 0.01
    assert permuted.size == i * h + h + h * c + c


def test_it_travels_to_workers():
    assert pickle.loads(pickle.dumps(SMALL)) == SMALL
    with pytest.raises(ValueError, match="3 workers"):
        SMALL.setup(0, 4)
