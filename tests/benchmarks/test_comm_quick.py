"""Smoke test for ``python -m benchmarks comm --quick``.

Runs the real CLI once as a subprocess (exactly as a user would, so the
``spawn``-ed peer processes and the entry-point lookup are exercised too) and
checks that every benchmark produced positive numbers for every scheme.
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
BENCHMARKS = ("roundtrip", "flood", "nchains", "pingpong-1MiB", "pingpong-64MiB")


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
        assert len(numbers["rounds"]) == data["config"]["rounds"], where
        assert all(v is not None and v > 0 for v in numbers["rounds"]), where
        assert numbers["median"] is not None and numbers["median"] > 0, where
