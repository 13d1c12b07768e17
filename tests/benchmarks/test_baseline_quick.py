"""Tests of ``--baseline PATH``: ``lci@baseline``, lci as built in PATH,
measured in the same run as the current build.

The baseline here is a copy of the checkout's package (the built C helper
included) in a temporary directory: what ``pip install --no-deps --target``
would put there, less the metadata, which importing by module path does not
need.  Where a process found ``dask_lcicomm`` tells the two builds apart.

* A child spawned with the configuration's ``pythonpath`` imports the copy,
  one without imports the checkout, and the parent is left as it was.
* So do the workers of a cluster started with it (spawned by nannies:
  grandchildren of the harness).
* A ``--quick`` comm run with ``--baseline`` measures lci@baseline and shows
  its column, the lci/lci@baseline ratio and where the baseline came from.
  No timing assertions.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli import REPO_ROOT, assert_all_measured, run_cli
from _origin_probe import answer_origins

from benchmarks import comm, dask
from benchmarks._cluster import started_cluster
from benchmarks._contenders import BASELINE_BUILD, Configuration
from benchmarks._procs import expect, report_origin, spawned

CHECKOUT = REPO_ROOT / "dask_lcicomm"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a copy of the package, as ``--baseline`` wants one."""
    path = tmp_path_factory.mktemp("baseline").resolve()
    shutil.copytree(CHECKOUT, path / "dask_lcicomm", ignore=shutil.ignore_patterns("__pycache__"))
    return path


def test_configurations(baseline: Path) -> None:
    """lci@baseline comes right after lci: plain lci, all its processes
    pointed at the baseline; its ratio column is lci/lci@baseline."""
    labels = [c.label for c in comm.configurations(["lci", "tcp"], baseline=str(baseline))]
    assert labels == ["lci", BASELINE_BUILD, "tcp"]
    built = comm.configurations(["lci", "tcp"], baseline=str(baseline))[1]
    assert (built.scheme, built.dask_config, built.pythonpath) == ("lci", (), str(baseline))
    assert ("lci", BASELINE_BUILD) in comm.ratio_pairs(labels)
    assert [c.label for c in dask.configurations(["lci", "tcp"], str(baseline))] == [
        "lci", BASELINE_BUILD, "tcp", "inproc"]
    assert BASELINE_BUILD not in [c.label for c in comm.configurations(["lci", "tcp"])]


def test_not_a_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no dask_lcicomm package"):
        comm.configurations(["lci"], baseline=str(tmp_path))


@pytest.mark.parametrize("with_baseline", [True, False], ids=["baseline", "current"])
def test_child_imports_its_build(baseline: Path, with_baseline: bool) -> None:
    path_before, env_before = list(sys.path), os.environ.get("PYTHONPATH")
    with spawned(report_origin, "dask_lcicomm", name="origin",
                 pythonpath=str(baseline) if with_baseline else None) as child:
        origin = Path(expect(child, "origin", timeout_s=60))
    assert origin.is_relative_to(baseline if with_baseline else CHECKOUT), origin
    assert (sys.path, os.environ.get("PYTHONPATH")) == (path_before, env_before)


def test_cluster_workers_import_the_baseline(baseline: Path) -> None:
    built = Configuration(BASELINE_BUILD, "lci", pythonpath=str(baseline))
    with started_cluster(built, answer_origins) as (cluster, workers):
        cluster.conn.send("origins")
        origins = expect(cluster, "origins", timeout_s=60)
    assert set(origins) == {"cluster", *workers}
    for process, origin in origins.items():
        assert Path(origin).is_relative_to(baseline), (process, origin)


def test_comm_run_with_baseline(baseline: Path, tmp_path: Path) -> None:
    run: dict[str, Any] = run_cli(
        ["comm", "--quick", "--schemes", "lci,tcp", "--baseline", str(baseline),
         "--benchmarks", "pingpong-8B"],
        tmp_path / "comm.json", timeout_s=120, plot=False)
    proc, data = run["proc"], run["data"]
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert {BASELINE_BUILD, "lci/tcp", f"lci/{BASELINE_BUILD}"} <= set(header), header
    assert f"{BASELINE_BUILD}: dask_lcicomm from {baseline / 'dask_lcicomm'}" in proc.stdout
    for label in ("lci", BASELINE_BUILD, "tcp"):
        assert_all_measured(data, label, {"pingpong-8B"})
    assert f"lci/{BASELINE_BUILD}" in data["config"]["ratios"]
    assert all(r["ratios"][f"lci/{BASELINE_BUILD}"] > 0 for r in data["results"])
    built = next(c for c in data["config"]["configurations"] if c["label"] == BASELINE_BUILD)
    assert built["pythonpath"] == str(baseline)
