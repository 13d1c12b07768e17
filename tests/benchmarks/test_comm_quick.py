"""Smoke test for ``python -m benchmarks comm --quick``.

Runs the real CLI once (see :mod:`_cli`) and checks that every benchmark
produced positive numbers for every scheme (the idle benchmark's CPU time may
be zero: an ideal backend).  No timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_all_measured, run_cli

SCHEMES = ("lci", "tcp")
BENCHMARKS = ("roundtrip", "flood", "nchains", "pingpong-1MiB", "pingpong-64MiB", "idle")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run for all schemes; each scheme is then checked separately
    so that a broken backend does not hide the state of the others."""
    out = tmp_path_factory.mktemp("bench") / "comm.json"
    return run_cli(["comm", "--quick", "--schemes", ",".join(SCHEMES)], out, timeout_s=240)


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    assert "lci/tcp" in stdout
    for name in BENCHMARKS:
        assert name in stdout
    assert "CPU s per 10 s idle (lower=better)" in stdout


@pytest.mark.parametrize("scheme", SCHEMES)
def test_positive_numbers(quick_run: dict[str, Any], scheme: str) -> None:
    assert_all_measured(quick_run["data"], scheme, set(BENCHMARKS))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_idle_measured_the_cluster(quick_run: dict[str, Any], scheme: str) -> None:
    """The idle rounds sampled the cluster's whole process tree (the child
    holding scheduler, client and nannies, plus 2 workers), and its CPU time
    is not negative."""
    raw = quick_run["data"]["raw"]
    rounds = [r for r in raw if r["benchmark"] == "idle" and r["configuration"] == scheme]
    assert rounds
    for r in rounds:
        assert r["error"] is None, r["error"]
        assert r["count"] >= 3, r  # processes seen
        assert r["seconds"] > 0, r
        assert r["cpu_seconds"] is not None and r["cpu_seconds"] >= 0, r
