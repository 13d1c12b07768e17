"""Smoke test for ``python -m benchmarks dask --quick``.

Runs the real CLI once with its default schemes (see :mod:`_cli`) and checks
that every graph produced a positive time for lci, tcp and the in-process
reference, that ucxx was either measured or is marked "not installed", and
that the figure was drawn.  No timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_all_measured, assert_figures, assert_scheme_column, run_cli

LABELS = ("lci", "tcp", "inproc")
BULK = ("move", "gather", "rechunk-tasks", "rechunk-p2p")
COMPUTE = ("array", "shuffle", "tree", "amt")
GRAPHS = {*BULK, *COMPUTE}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run for all schemes (and inproc); each configuration is then
    checked separately so that a broken backend does not hide the others."""
    out = tmp_path_factory.mktemp("bench") / "dask.json"
    return run_cli(["dask", "--quick"], out, timeout_s=240) | {"out": out}


def test_exit_status(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    for column in ("lci [s]", "tcp [s]", "ucxx [s]", "inproc [s]", "lci/tcp", "inproc/tcp"):
        assert column in stdout
    for name in GRAPHS:
        assert f"\n{name} " in stdout, name


@pytest.mark.parametrize("label", LABELS)
def test_positive_times(quick_run: dict[str, Any], label: str) -> None:
    assert_all_measured(quick_run["data"], label, GRAPHS)


def test_ucxx_measured_or_marked(quick_run: dict[str, Any]) -> None:
    assert_scheme_column(quick_run["data"], quick_run["proc"].stdout, "ucxx", GRAPHS)


def test_kinds_recorded(quick_run: dict[str, Any]) -> None:
    kinds = {r["benchmark"]: r["kind"] for r in quick_run["data"]["results"]}
    assert kinds == {**dict.fromkeys(BULK, "bulk"), **dict.fromkeys(COMPUTE, "compute")}


def test_ratios_recorded(quick_run: dict[str, Any]) -> None:
    """The JSON carries the ratios of the table's columns (<x>/tcp, oriented: >1 = faster)."""
    for result in quick_run["data"]["results"]:
        ratios = result["ratios"]
        assert {"lci/tcp", "inproc/tcp"} <= set(ratios), result["benchmark"]
        assert ratios["lci/tcp"] > 0 and ratios["inproc/tcp"] > 0, result["benchmark"]


def test_figure_drawn(quick_run: dict[str, Any]) -> None:
    assert_figures(quick_run["out"].parent / "figures", {"dask.png"})
