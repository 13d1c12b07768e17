"""Emulated compute time and slowdowns."""

from __future__ import annotations

from dask_lcicomm.asap.pacing import Pacing


def test_transient_slows_exactly_one_worker_per_round_and_varies():
    pacing = Pacing(0.01, 5.0, transient=True, seed=3)
    slow = [[r for r in range(8) if pacing.slow(r, rnd, 8)] for rnd in range(200)]
    assert all(len(s) == 1 for s in slow)
    assert len({s[0] for s in slow}) == 8
    rank = slow[0][0]
    assert pacing.duration(rank, 0, 8) == 0.05
    assert pacing.duration((rank + 1) % 8, 0, 8) == 0.01


def test_straggler_is_always_slow_and_alone():
    pacing = Pacing(0.01, 4.0, straggler=2)
    assert all(pacing.slow(2, r, 8) for r in range(50))
    assert not any(pacing.slow(k, r, 8) for k in (0, 1, 3) for r in range(50))


def test_default_is_no_padding():
    assert Pacing().duration(0, 0, 4) == 0.0
