"""Helpers shared by the benchmark smoke tests: run the real CLI, check its JSON.

The CLI runs as a subprocess, exactly as a user would start it, so the
``spawn``-ed peer processes and the entry-point lookup are exercised too.
There are deliberately no timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


#: What every PNG file starts with.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(args: list[str], out: Path, timeout_s: float, plot: bool = True) -> dict[str, Any]:
    """Run ``python -m benchmarks <args> --json out --plot <out's folder>/figures``
    (without ``--plot`` if not ``plot``); its process and JSON."""
    figures = ["--plot", str(out.parent / "figures")] if plot else []
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--json", str(out), *figures],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.exists(), f"no JSON written (rc={proc.returncode}):\n{proc.stderr}"
    return {"proc": proc, "data": json.loads(out.read_text())}


def _acceptable(value: float | None, higher_is_better: bool) -> bool:
    """Rates must be positive; a lower-is-better cost (idle CPU) may be zero."""
    if value is None:
        return False
    return value > 0 if higher_is_better else value >= 0


def assert_all_measured(data: dict[str, Any], label: str, benchmarks: set[str]) -> None:
    """Configuration ``label`` ran without errors and every round of every
    metric of ``benchmarks`` produced an acceptable number."""
    status = data["status"][label]
    assert status["available"], f"{label}: {status['label']}: {status['detail']}"

    results = data["results"]
    assert {r["benchmark"] for r in results} == benchmarks
    errors = [r["error"] for r in data["raw"] if r["configuration"] == label and r["error"]]
    assert not errors, errors
    for result in results:
        numbers = result["per_configuration"][label]
        where = f"{label} {result['benchmark']} {result['metric']}"
        good = result["higher_is_better"]
        assert len(numbers["rounds"]) == data["config"]["rounds"], where
        assert all(_acceptable(v, good) for v in numbers["rounds"]), where
        assert _acceptable(numbers["median"], good), where


def assert_figures(folder: Path, names: set[str]) -> None:
    """Exactly ``names`` were drawn into ``folder``, each a PNG with content."""
    assert {path.name for path in folder.glob("*.png")} == names
    for name in names:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 10_000, f"{name}: {len(data)} bytes, an empty figure?"


def assert_scheme_column(data: dict[str, Any], stdout: str, scheme: str, benchmarks: set[str]) -> None:
    """An optional scheme (or configuration, by label) was either measured in
    full, or it is marked not installed in the JSON and in the table instead
    of failing the run."""
    status = data["status"][scheme]
    if status["available"]:
        assert_all_measured(data, scheme, benchmarks)
    else:
        assert status["label"] == "not installed", status
        assert not [r for r in data["raw"] if r["configuration"] == scheme]
        assert "not installed" in stdout
