"""The reduce rule."""

from __future__ import annotations

import numpy as np

from dask_lcicomm.asap.reduce import average


def test_average_is_the_mean_and_a_new_array():
    own = np.array([1.0, 2.0])
    out = average(own, [np.array([3.0, 4.0]), np.array([5.0, 6.0])])
    assert np.allclose(out, [3.0, 4.0])
    assert out is not own and np.allclose(own, [1.0, 2.0])


def test_average_of_nothing_else_is_a_copy():
    own = np.array([1.0, 2.0])
    out = average(own, [])
    assert np.array_equal(out, own) and out is not own
