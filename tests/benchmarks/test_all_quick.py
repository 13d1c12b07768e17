"""Smoke test for ``python -m benchmarks all --quick`` and for drawing a
saved run again with ``python -m benchmarks plot``.

``all`` runs comm, dask and variants (here with one variant, to stay short)
in one go: every command's table is printed, the JSON holds each command's
results under its name, and all the figures are drawn.  No timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from _cli import REPO_ROOT, assert_figures, run_cli

COMMANDS = ("comm", "dask", "variants")
FIGURES = {"comm-latency.png", "comm-bandwidth.png", "comm-flood.png", "comm-nchains.png",
           "dask.png", "variants.png"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "all.json"
    return run_cli(["all", "--quick", "--variants", "ndevices-2"], out, timeout_s=400) | {"out": out}


def test_exit_status(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr


def test_every_command_ran(quick_run: dict[str, Any]) -> None:
    data = quick_run["data"]
    assert data["command"] == "all"
    for command in COMMANDS:
        assert data[command]["command"] == command
        assert data[command]["config"]["quick"] is True
        assert data[command]["results"], command
        assert data[command]["failed"] == 0, command
    assert {c["label"] for c in data["variants"]["config"]["configurations"]} == {
        "lci", "tcp", "ndevices-2"}


def test_tables_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    assert "pingpong-64MiB" in stdout and "rechunk-p2p" in stdout and "ndevices-2" in stdout


def test_figures_drawn(quick_run: dict[str, Any]) -> None:
    assert_figures(quick_run["out"].parent / "figures", FIGURES)


def test_saved_run_drawn_again(quick_run: dict[str, Any], tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "plot", str(quick_run["out"]), "--plot", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert_figures(tmp_path, FIGURES)
