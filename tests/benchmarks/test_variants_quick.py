"""Tests of ``python -m benchmarks variants``.

* A ``--quick`` smoke run of the real CLI, restricted to three variants to
  stay short: every configuration (default lci, tcp and the variants)
  produced positive numbers for every benchmark, or -- for the shared-memory
  provider only -- was rejected at start-up and is marked unavailable, or --
  for the UCX provider only -- is marked not installed (without the ucx
  extra, as in CI; there it costs no time).  No timing assertions.
* A configuration the backend rejects at start-up is marked unavailable in
  its row, and the run goes on with the others.
* Every variant, applied to a peer process the way the harness does it,
  really switches its knob (and only it) in the settings the backend reads
  there: an ablation whose knob silently stayed at its default would report
  noise as a finding.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import dask.config
import pytest
from _cli import assert_all_measured, assert_figures, run_cli
from _settings_probe import report_settings

from benchmarks import _runner, comm
from benchmarks._contenders import Configuration, probe
from benchmarks._procs import expect, spawned
from benchmarks.comm import VARIANT_BENCHMARKS as BENCHMARKS
from benchmarks.comm import VARIANTS, variant
from dask_lcicomm.config import Settings

SMOKE_VARIANTS = ("sync", "providers-shm", "providers-ucx")
LABELS = ("lci", "tcp", *SMOKE_VARIANTS)

#: The two provider variants: one of them restates the shipped default.
PROVIDER_VARIANTS = ("providers-tcp", "providers-shm")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "variants.json"
    args = ["variants", "--quick", "--variants", ",".join(SMOKE_VARIANTS)]
    return run_cli(args, out, timeout_s=180) | {"out": out}


def test_exit_status(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr


def test_table_has_a_row_per_variant(quick_run: dict[str, Any]) -> None:
    lines = quick_run["proc"].stdout.splitlines()
    for label in ("lci (default)", "tcp", *SMOKE_VARIANTS):
        assert any(line.startswith(f"{label} ") for line in lines), label
    for name in BENCHMARKS:
        assert name in lines[0]


def test_table_says_what_each_variant_set(quick_run: dict[str, Any]) -> None:
    rows = {line.split()[0]: line for line in quick_run["proc"].stdout.splitlines() if line}
    assert "completion=sync" in rows["sync"]
    assert "providers=[shm, tcp]" in rows["providers-shm"]
    assert "providers=[ucx, tcp]" in rows["providers-ucx"]


@pytest.mark.parametrize("label", LABELS)
def test_measured_or_unavailable(quick_run: dict[str, Any], label: str) -> None:
    data = quick_run["data"]
    excuse = {"providers-shm": "unavailable", "providers-ucx": "not installed"}.get(label)
    if excuse and not data["status"][label]["available"]:
        assert data["status"][label]["label"] == excuse
        row = next(line for line in quick_run["proc"].stdout.splitlines()
                   if line.startswith(f"{label} "))
        assert row.count(excuse) == len(BENCHMARKS)
    else:
        assert_all_measured(data, label, set(BENCHMARKS))


def test_ratios_against_default(quick_run: dict[str, Any]) -> None:
    data = quick_run["data"]
    measured = {label for label in LABELS if data["status"][label]["available"]} - {"lci"}
    for result in data["results"]:
        ratios = result["ratios"]
        assert set(ratios) == {f"{label}/lci" for label in set(LABELS) - {"lci"}}
        assert all(ratios[f"{label}/lci"] > 0 for label in measured), result


def test_figure_drawn(quick_run: dict[str, Any]) -> None:
    assert_figures(quick_run["out"].parent / "figures", {"variants.png"})


def test_rejected_configuration_is_unavailable() -> None:
    """A provider the backend does not ship: its row says "unavailable" and
    the default lci is still measured in the same run."""
    bogus = variant("providers-bogus", {"providers": ["bogus", "tcp"]})
    result = _runner.run("variants", [Configuration.of_scheme("lci"), bogus],
                         comm.benchmarks(["pingpong-8B"], quick=True), 1, True, comm.run_round)
    assert not result.status["providers-bogus"].available
    assert "rejected at start-up" in result.status["providers-bogus"].detail
    assert "bogus" in result.status["providers-bogus"].detail
    assert {r.configuration for r in result.records} == {"lci"}
    assert not result.failures()
    table = comm.variants_table(result)
    row = next(line for line in table.splitlines() if line.startswith("providers-bogus "))
    assert row.split()[-1] == "unavailable"


def _knobs(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings by knob name (``_`` for ``-``), a provider section's options
    as ``<section>.<option>``."""
    sections = settings.pop("sections")
    flat = {f"{name}.{option}": value for name, options in sections.items()
            for option, value in options.items()}
    return {key.replace("-", "_"): value for key, value in {**settings, **flat}.items()}


def _settings_in(dask_config: dict[str, Any]) -> dict[str, Any]:
    with dask.config.set(dask_config):
        return asdict(Settings.from_config())


def _knob_names(c: Configuration) -> set[str]:
    return {key.removeprefix(f"{comm.LCI}.").replace("-", "_") for key, _ in c.dask_config}


@pytest.mark.parametrize("c", VARIANTS.values(), ids=lambda c: c.label)
def test_variant_switches_its_knob(c: Configuration) -> None:
    try:
        expected = _settings_in(c.overrides)
    except ValueError:  # not accepted by this build: the harness must say so
        status = probe([c])[c.label]
        assert not status.available and "rejected at start-up" in status.detail
        return
    with spawned(report_settings, name=f"{c.label}-probe", dask_config=c.overrides) as child:
        settings = expect(child, "settings", timeout_s=60)
    assert settings == expected
    default = _knobs(asdict(Settings.from_config()))  # what the child has without the variant
    changed = {key for key, value in _knobs(settings).items() if value != default[key]}
    # progress-threads=2 only means something with progress=thread: both must
    # change; one provider variant restates the shipped providers (see below).
    restates_default = c.label in PROVIDER_VARIANTS and not changed
    assert changed == (set() if restates_default else _knob_names(c))


def test_provider_variants_differ() -> None:
    """Of the two provider variants, one may be the default, not both."""
    settings = [VARIANTS[label].overrides for label in PROVIDER_VARIANTS]
    assert len(settings) == 2 and settings[0] != settings[1]


def test_provider_variants_pinned() -> None:
    """Each providers variant is pinned to its first provider (its peers fail
    on a fallback), and the UCX one needs the ucx extra."""
    for c in VARIANTS.values():
        providers = c.overrides.get(f"{comm.LCI}.providers")
        assert c.provider == (providers[0] if providers else None)
    ucx = VARIANTS["providers-ucx"]
    assert ucx.requires == "ucxx" and ucx.overrides == {
        "distributed.comm.lci.providers": ["ucx", "tcp"]}
