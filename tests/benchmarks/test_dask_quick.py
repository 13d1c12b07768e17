"""Smoke test for ``python -m benchmarks dask --quick``.

Runs the real CLI once (see :mod:`_cli`) and checks that every graph produced
a positive time for lci and tcp, and that the in-process reference ran too.
No timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_all_measured, run_cli

SCHEMES = ("lci", "tcp")
GRAPHS = ("move", "gather", "array", "tree", "shuffle")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run for both schemes (and inproc); each configuration is then
    checked separately so that a broken backend does not hide the others."""
    out = tmp_path_factory.mktemp("bench") / "dask.json"
    return run_cli(["dask", "--quick", "--schemes", ",".join(SCHEMES)], out, timeout_s=240)


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    for column in ("lci [s]", "tcp [s]", "inproc [s]", "lci/tcp", "inproc/tcp"):
        assert column in stdout
    for name in GRAPHS:
        assert name in stdout


@pytest.mark.parametrize("label", [*SCHEMES, "inproc"])
def test_positive_times(quick_run: dict[str, Any], label: str) -> None:
    assert_all_measured(quick_run["data"], label, set(GRAPHS))


def test_time_ratios_recorded(quick_run: dict[str, Any]) -> None:
    """The JSON carries the table's ratios (<x>/tcp, <1 = faster)."""
    for result in quick_run["data"]["results"]:
        ratios = result["time_ratio_vs_baseline"]
        assert set(ratios) == {"lci", "inproc"}, result["benchmark"]
        assert all(r is not None and r > 0 for r in ratios.values()), result["benchmark"]
