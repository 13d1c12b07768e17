"""The sources pass ``ruff check`` and ``mypy`` as configured in pyproject.toml.

Both run as subprocesses of this interpreter, so the versions the ``test``
extra installs are the ones that judge, and from the repository root, so they
read its configuration. ``ruff format`` is not enforced: the code keeps its
own hand-wrapped style.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, args: list[str], timeout: float) -> None:
    result = subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{tool} found problems:\n{result.stdout}{result.stderr}"


def test_ruff_check():
    _run("ruff", ["check", "--no-cache", "--output-format", "concise",
                  "dask_lcicomm", "tests", "benchmarks", "examples"], timeout=60)


# A cold run (the cache lives and dies with the test) takes 10-20 s; the
# files it checks are listed in pyproject.toml.
@pytest.mark.timeout(240)
def test_mypy(tmp_path):
    _run("mypy", ["--cache-dir", str(tmp_path / "mypy-cache")], timeout=180)
