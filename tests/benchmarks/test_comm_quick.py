"""Smoke test for ``python -m benchmarks comm --quick``.

Runs the real CLI once as a subprocess (exactly as a user would, so the
``spawn``-ed peer processes and the entry-point lookup are exercised too) and
checks that every benchmark produced positive numbers for every scheme (the
idle benchmark's CPU time may be zero: an ideal backend).
There are deliberately no timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMES = ("lci", "tcp")
BENCHMARKS = ("roundtrip", "flood", "nchains", "pingpong-1MiB", "pingpong-64MiB", "idle")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run for all schemes; each scheme is then checked separately
    so that a broken backend does not hide the state of the others."""
    out = tmp_path_factory.mktemp("bench") / "comm.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "comm", "--quick",
         "--schemes", ",".join(SCHEMES), "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), f"no JSON written (rc={proc.returncode}):\n{proc.stderr}"
    return {"proc": proc, "data": json.loads(out.read_text())}


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    assert "lci/tcp" in stdout
    for name in BENCHMARKS:
        assert name in stdout
    assert "CPU s per 10 s idle (lower=better)" in stdout


def _acceptable(value: float | None, higher_is_better: bool) -> bool:
    """Rates must be positive; a lower-is-better cost (idle CPU) may be zero."""
    if value is None:
        return False
    return value > 0 if higher_is_better else value >= 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_positive_numbers(quick_run: dict[str, Any], scheme: str) -> None:
    data = quick_run["data"]
    status = data["schemes"][scheme]
    assert status["available"], f"{scheme}: {status['label']}: {status['detail']}"

    results = data["results"]
    assert {r["benchmark"] for r in results} == set(BENCHMARKS)
    errors = [r["error"] for r in data["raw"] if r["scheme"] == scheme and r["error"]]
    assert not errors, errors
    for result in results:
        numbers = result["per_scheme"][scheme]
        where = f"{scheme} {result['benchmark']} {result['metric']}"
        good = result["higher_is_better"]
        assert len(numbers["rounds"]) == data["config"]["rounds"], where
        assert all(_acceptable(v, good) for v in numbers["rounds"]), where
        assert _acceptable(numbers["median"], good), where


@pytest.mark.parametrize("scheme", SCHEMES)
def test_idle_measured_the_cluster(quick_run: dict[str, Any], scheme: str) -> None:
    """The idle rounds sampled the cluster's whole process tree (the child
    holding scheduler, client and nannies, plus 2 workers), and its CPU time
    is not negative."""
    raw = quick_run["data"]["raw"]
    rounds = [r for r in raw if r["benchmark"] == "idle" and r["scheme"] == scheme]
    assert rounds
    for r in rounds:
        assert r["error"] is None, r["error"]
        assert r["count"] >= 3, r  # processes seen
        assert r["seconds"] > 0, r
        assert r["cpu_seconds"] is not None and r["cpu_seconds"] >= 0, r
