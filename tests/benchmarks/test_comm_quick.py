"""Smoke test for ``python -m benchmarks comm --quick``.

Runs the real CLI once with its default configurations (see :mod:`_cli`)
and checks that every benchmark the suite promises produced positive numbers
for lci, lci over its tcp provider and tcp (the idle benchmark's CPU time may
be zero: an ideal backend), that ucxx and lci over its ucx provider were
either measured or are marked "not installed" (without the ucx extra, as in
CI), and that the figures were drawn.  No timing assertions: the CI machines
are noisy.

Then, on the harness directly: a configuration pinned to a provider that its
comms do not run over fails loudly instead of measuring the fallback, and
one whose extra is missing is "not installed".
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_all_measured, assert_figures, assert_scheme_column, run_cli

from benchmarks import _runner, comm
from benchmarks._contenders import Configuration, probe

SCHEMES = ("lci", "lci-tcp", "tcp")
#: Measured where the ucx extra is installed, else marked "not installed".
OPTIONAL = ("ucxx", "lci-ucx")
#: Ratio columns beyond <x>/tcp.
EXTRA_RATIOS = ("lci/ucxx", "lci-ucx/ucxx")
SIZES = ("8B", "64B", "1KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB")
BENCHMARKS = {
    *(f"pingpong-{size}" for size in SIZES),
    *(f"flood-{size}-x{n}" for size in ("8B", "16KiB") for n in (1, 4, 16)),
    *(f"nchains-{n}" for n in (1, 4, 16, 64, 256, 1024)),
    "idle",
}
FIGURES = {"comm.png"}


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
    # not the first line: UCX may print warnings to stdout before it
    header = set(next(line for line in stdout.splitlines() if line.startswith("benchmark ")).split())
    labels = (*SCHEMES, *OPTIONAL)
    assert set(labels) <= header
    assert {f"{label}/tcp" for label in labels if label != "tcp"} | set(EXTRA_RATIOS) <= header
    for name in BENCHMARKS:
        assert f"\n{name} " in stdout, name
    assert "CPU s per 10 s idle (lower=better)" in stdout


@pytest.mark.parametrize("scheme", SCHEMES)
def test_positive_numbers(quick_run: dict[str, Any], scheme: str) -> None:
    assert_all_measured(quick_run["data"], scheme, BENCHMARKS)


@pytest.mark.parametrize("label", OPTIONAL)
def test_optional_measured_or_marked(quick_run: dict[str, Any], label: str) -> None:
    assert_scheme_column(quick_run["data"], quick_run["proc"].stdout, label, BENCHMARKS)


def test_pinned_configurations_recorded(quick_run: dict[str, Any]) -> None:
    """The JSON says which providers lci-tcp and lci-ucx set and are pinned to."""
    configurations = {c["label"]: c for c in quick_run["data"]["config"]["configurations"]}
    for label, providers in (("lci-tcp", ["tcp"]), ("lci-ucx", ["ucx", "tcp"])):
        assert configurations[label]["dask_config"] == {"distributed.comm.lci.providers": providers}
        assert configurations[label]["provider"] == providers[0]
    assert configurations["lci-ucx"]["requires"] == "ucxx"


@pytest.mark.parametrize("ratio", EXTRA_RATIOS)
def test_ratio_against_ucxx(quick_run: dict[str, Any], ratio: str) -> None:
    """A ratio to ucxx wherever both sides have a median (none where one is
    not installed), and then some."""
    data = quick_run["data"]
    values = []
    for result in data["results"]:
        medians = [result["per_configuration"][label]["median"] for label in ratio.split("/")]
        value = result["ratios"][ratio]
        assert (value is None) == (None in medians), result
        assert value is None or value > 0, result
        values.append(value)
    measured = all(data["status"][label]["available"] for label in ratio.split("/"))
    assert any(values) == measured


def test_sweep_and_chains_recorded(quick_run: dict[str, Any]) -> None:
    """The JSON says what each benchmark was: sizes and concurrency."""
    specs = {s["name"]: s for s in quick_run["data"]["config"]["benchmarks"]}
    assert specs["pingpong-8B"]["payload_bytes"] == 8
    assert specs["pingpong-64MiB"]["payload_bytes"] == 64 * 2**20
    assert specs["flood-16KiB-x16"]["payload_bytes"] == 16 * 2**10
    assert specs["flood-16KiB-x16"]["comms"] == 16
    assert specs["nchains-1024"]["comms"] == 1024


@pytest.mark.parametrize("scheme", [*SCHEMES, "lci-ucx"])
def test_idle_measured_the_cluster(quick_run: dict[str, Any], scheme: str) -> None:
    """The idle rounds sampled the cluster's whole process tree (the child
    holding scheduler, client and nannies, plus 2 workers), and its CPU time
    is not negative."""
    if not quick_run["data"]["status"][scheme]["available"]:
        pytest.skip(f"{scheme} not installed (checked by test_optional_measured_or_marked)")
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


def test_fallback_fails_loudly() -> None:
    """lci over tcp pinned to shm: every comm and the idle cluster's links
    run over tcp, so each benchmark fails saying so -- it must not report
    tcp's numbers under a label that names another provider."""
    mispinned = Configuration("mispinned", "lci", (("distributed.comm.lci.providers", ["tcp"]),),
                              provider="shm")
    result = _runner.run("comm", [mispinned], comm.benchmarks(["pingpong-8B", "idle"], quick=True),
                         1, True, comm.run_round)
    errors = {r.benchmark: r.error for r in result.records}
    assert set(errors) == {"pingpong-8B", "idle"} and all(errors.values()), errors
    assert "WrongProvider" in errors["pingpong-8B"] and "'tcp', not 'shm'" in errors["pingpong-8B"]
    assert "links over providers" in errors["idle"] and "'shm'" in errors["idle"], errors["idle"]


def test_missing_extra_is_not_installed() -> None:
    """A configuration whose extra is missing is marked, never started."""
    needy = Configuration("needy", "lci", requires="no_such_module_for_lci_benchmarks")
    status = probe([needy])["needy"]
    assert not status.available and status.label == "not installed", status
    assert "no_such_module_for_lci_benchmarks" in status.detail


def test_pinned_configurations_in_the_default_run() -> None:
    """lci-tcp and lci-ucx run by default, pinned, and may also be chosen alone."""
    configurations = {c.label: c for c in comm.configurations(comm.DEFAULT_NAMES)}
    assert configurations["lci-tcp"].provider == "tcp"
    assert configurations["lci-ucx"].provider == "ucx"
    assert configurations["lci-ucx"].requires == "ucxx"
    assert [c.label for c in comm.configurations(["lci-ucx", "tcp"])] == ["lci-ucx", "tcp"]
