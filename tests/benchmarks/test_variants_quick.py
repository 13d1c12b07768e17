"""Tests of ``python -m benchmarks variants``.

* A ``--quick`` smoke run of the real CLI, restricted to two variants to stay
  short: every configuration (default lci, tcp and both variants) produced
  positive numbers for every benchmark.  No timing assertions.
* Every variant, applied to a peer process the way the harness does it,
  really switches its knob (and only it) in the settings the backend reads
  there: an ablation whose knob silently stayed at its default would report
  noise as a finding.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
from _cli import assert_all_measured, run_cli
from _settings_probe import report_settings

from benchmarks._procs import expect, spawned
from benchmarks.variants import VARIANTS, Variant
from dask_lcicomm.config import Settings

SMOKE_VARIANTS = ("thread", "eager-0")
LABELS = ("lci", "tcp", *SMOKE_VARIANTS)
BENCHMARKS = {"roundtrip", "flood", "nchains", "pingpong-1MiB", "pingpong-64MiB"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "variants.json"
    args = ["variants", "--quick", "--variants", ",".join(SMOKE_VARIANTS)]
    return run_cli(args, out, timeout_s=180)


def test_table_has_a_row_per_variant(quick_run: dict[str, Any]) -> None:
    lines = quick_run["proc"].stdout.splitlines()
    for label in ("lci (default)", "tcp", *SMOKE_VARIANTS):
        assert any(line.startswith(f"{label} ") for line in lines), label
    for name in BENCHMARKS:
        assert name in lines[0]


@pytest.mark.parametrize("label", LABELS)
def test_positive_numbers(quick_run: dict[str, Any], label: str) -> None:
    assert_all_measured(quick_run["data"], label, BENCHMARKS)


def test_ratios_against_default(quick_run: dict[str, Any]) -> None:
    for result in quick_run["data"]["results"]:
        ratios = result["ratio_vs_baseline"]
        assert set(ratios) == set(LABELS) - {"lci"}
        assert all(r is not None and r > 0 for r in ratios.values()), result


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_variant_switches_its_knob(variant: Variant) -> None:
    with spawned(report_settings, name=f"{variant.name}-probe",
                 dask_config=variant.dask_config) as child:
        settings = expect(child, "settings", timeout_s=60)
    default = asdict(Settings.from_config())  # what the child has without the variant
    changed = {key for key, value in settings.items() if value != default[key]}
    # progress-threads=2 only means something with progress=thread: both must change.
    assert changed == {key.replace("-", "_") for key, _ in variant.knobs}
