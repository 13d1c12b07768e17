"""``python -m benchmarks report``: saved runs as pages and tables, and the
README's table as that command prints it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks._runner import format_number, format_ratio
from benchmarks.plots import _ratios
from benchmarks.report import page, results_table, run_name

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_every_published_run_makes_a_page(path, tmp_path):
    data = json.loads(path.read_text())
    text = page(data, [tmp_path / "figure.png"], tmp_path)
    assert text.startswith(f"# {run_name(data)}\n")
    assert data["environment"]["timestamp"][:10] in text
    assert "![figure](figure.png)" in text
    assert text.count("|---|") >= 1


def test_a_table_row_is_the_median_of_its_rounds():
    data = json.loads((RESULTS / "comm-providers.json").read_text())
    table = results_table(data, ["pingpong-8B:latency"], ["lci/tcp"], ["lci", "tcp"])
    result = next(r for r in data["results"] if r["benchmark"] == "pingpong-8B")
    lci = sorted(result["per_configuration"]["lci"]["rounds"])[1]
    tcp = sorted(result["per_configuration"]["tcp"]["rounds"])[1]
    row = table.splitlines()[2].split(" | ")
    assert row[2:] == [format_number(lci), format_number(tcp), f"{format_ratio(tcp / lci)} |"]


def test_the_readme_table_is_what_its_command_prints():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^python -m benchmarks report .*$", readme, re.MULTILINE)
    assert command is not None
    argv = shlex.split(command.group(0))[1:]
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() in readme


def test_a_row_the_run_does_not_have_is_an_error_naming_the_rows_it_has():
    data = json.loads((RESULTS / "comm-providers.json").read_text())
    with pytest.raises(ValueError, match="no row pingpong-3B:latency in this run; it has pingpong-8B:"):
        results_table(data, ["pingpong-3B:latency"])


def test_a_saved_run_is_drawn_again(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "report",
                           str(RESULTS / "comm-providers.json"), "--plot", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in tmp_path.glob("*.png")} == {"comm.png"}


def test_the_figure_ratios_favour_the_better_whichever_way_the_metric_points():
    data = json.loads((RESULTS / "comm-providers.json").read_text())
    for result in data["results"][:2]:  # pingpong-8B: latency (lower is better), bandwidth
        lci, tcp = (result["per_configuration"][label] for label in ("lci", "tcp"))
        median, rounds = _ratios(result, "lci", "tcp")
        expected = (lci["median"] / tcp["median"] if result["higher_is_better"]
                    else tcp["median"] / lci["median"])
        assert median == pytest.approx(expected) and median > 1
        assert len(rounds) == len(lci["rounds"])
    idle = data["results"][-1] | {"per_configuration": {"a": {"median": 0.0, "rounds": [None]}}}
    median, rounds = _ratios(idle, "a", "a")
    assert np.isnan(median) and np.isnan(rounds).all()  # no bar, no dot
