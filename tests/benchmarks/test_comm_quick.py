"""Smoke test for ``python -m benchmarks comm --quick``.

Runs the real CLI once with its default schemes (see :mod:`_cli`) and checks
that every benchmark the suite promises produced positive numbers for lci
and tcp (the idle benchmark's CPU time may be zero: an ideal backend), that
ucxx was either measured or is marked "not installed", and that the figures
were drawn.  No timing assertions: the CI machines are noisy.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_all_measured, assert_figures, assert_scheme_column, run_cli

SCHEMES = ("lci", "tcp")
SIZES = ("8B", "64B", "1KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB")
BENCHMARKS = {
    *(f"pingpong-{size}" for size in SIZES),
    *(f"flood-{size}-x{n}" for size in ("8B", "16KiB") for n in (1, 4, 16)),
    *(f"nchains-{n}" for n in (1, 4, 16, 64, 256, 1024)),
    "idle",
}
FIGURES = {"comm-latency.png", "comm-bandwidth.png", "comm-flood.png", "comm-nchains.png"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run for all schemes; each scheme is then checked separately
    so that a broken backend does not hide the state of the others."""
    out = tmp_path_factory.mktemp("bench") / "comm.json"
    return run_cli(["comm", "--quick"], out, timeout_s=240) | {"out": out}


def test_exit_status(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    assert "lci/tcp" in stdout
    for name in BENCHMARKS:
        assert f"\n{name} " in stdout, name
    assert "CPU s per 10 s idle (lower=better)" in stdout


@pytest.mark.parametrize("scheme", SCHEMES)
def test_positive_numbers(quick_run: dict[str, Any], scheme: str) -> None:
    assert_all_measured(quick_run["data"], scheme, BENCHMARKS)


def test_ucxx_measured_or_marked(quick_run: dict[str, Any]) -> None:
    assert_scheme_column(quick_run["data"], quick_run["proc"].stdout, "ucxx", BENCHMARKS)


def test_targets_judged_or_explained(quick_run: dict[str, Any]) -> None:
    """The comm targets are in the JSON: those against tcp always judged; those
    against ucxx with a ratio and a verdict when ucxx ran, else with the reason
    there is none."""
    data = quick_run["data"]
    targets = data["targets"]
    against_tcp = [t for t in targets if "lci/tcp" in t["wanted"]]
    assert {t["benchmark"] for t in against_tcp} >= {"pingpong-8B", "pingpong-64MiB", "flood-16KiB-x1"}
    for target in against_tcp:
        assert target["ratio"] > 0 and isinstance(target["met"], bool), target
    against_ucxx = [t for t in targets if "lci/ucxx" in t["wanted"]]
    assert {t["benchmark"] for t in against_ucxx} >= {"pingpong-8B", "pingpong-1MiB"}
    for target in against_ucxx:
        if data["status"]["ucxx"]["available"]:
            assert target["ratio"] > 0 and isinstance(target["met"], bool), target
        else:
            assert target["ratio"] is None and target["met"] is None, target
            assert target["why_not"] == "ucxx not installed", target


def test_sweep_and_chains_recorded(quick_run: dict[str, Any]) -> None:
    """The JSON says what each benchmark was: sizes and concurrency."""
    specs = {s["name"]: s for s in quick_run["data"]["config"]["benchmarks"]}
    assert specs["pingpong-8B"]["payload_bytes"] == 8
    assert specs["pingpong-64MiB"]["payload_bytes"] == 64 * 2**20
    assert specs["flood-16KiB-x16"]["payload_bytes"] == 16 * 2**10
    assert specs["flood-16KiB-x16"]["comms"] == 16
    assert specs["nchains-1024"]["comms"] == 1024


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


def test_figures_drawn(quick_run: dict[str, Any]) -> None:
    assert_figures(quick_run["out"].parent / "figures", FIGURES)
