"""Cluster-wide measurements from per-worker reports."""

from __future__ import annotations

import pytest

from dask_lcicomm.asap.report import RunReport, WorkerReport


def worker(rank, reduces, curve):
    return WorkerReport(rank=rank, address=f"w{rank}", rounds=curve[-1][1], elapsed_s=curve[-1][0],
                        bytes_sent=curve[-1][2], messages_sent=0, dropped=0, wait_s=1.0 + rank,
                        step_s=0.0, max_staleness=0, timed_out=False, start_lag_s=0.0,
                        reduces=reduces, curve=curve, final_loss=curve[-1][3], final_accuracy=0.5)


def report():
    a = worker(0, [(1.0, 1, 10), (2.0, 2, 20), (3.0, 3, 30)],
               [(0.0, 0, 0, 1.0), (1.0, 1, 10, 0.6), (3.0, 3, 30, 0.2)])
    b = worker(1, [(1.5, 1, 5), (4.0, 2, 10)],
               [(0.0, 0, 0, 1.0), (1.5, 1, 5, 0.8), (4.0, 2, 10, 0.4)])
    return RunReport("asap", "g", 0.5, 1.0, [a, b])


def test_curve_is_the_mean_of_latest_losses_and_the_sum_of_bytes():
    points = report().curve()
    assert [p.t for p in points] == [0.0, 1.0, 1.5, 3.0, 4.0]  # once every worker has a point
    at_three = points[3]
    assert at_three.loss == pytest.approx((0.2 + 0.8) / 2)
    assert at_three.bytes == 35 and at_three.rounds == 2.0


def test_first_below_target():
    assert report().first_below(0.5).t == 3.0
    assert report().first_below(0.1) is None


def test_iteration_gap_from_reduce_timestamps():
    # at t=3.0 worker 0 has 3 rounds, worker 1 has 1
    assert report().iteration_gaps() == [2, 2]
    assert report().max_iteration_gap() == 2


def test_aggregates():
    r = report()
    assert r.final_loss == pytest.approx(0.3)
    assert r.bytes_sent == 40 and r.wait_s == pytest.approx(1.5)
