"""Smoke test for ``python -m benchmarks.cluster_memory`` on a small cluster:
the work's results are checked by the benchmark itself; here, that every
configuration ran and reported its samples and the workers' reactions."""

from __future__ import annotations

import json
import subprocess
import sys

from _cli import REPO_ROOT

KEYS = {"shuffle_s", "rechunk_s", "peak_shmem", "peak_pss", "after_shmem", "after_pss",
        "released_shmem", "released_pss", "spills", "pauses", "restarts", "workers"}


def test_cluster_memory_small_run(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_memory", "--workers", "2", "--rows", "200000",
         "--configs", "tcp,lci", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for name in ("tcp", "lci"):
        [result] = data["results"][name]
        assert set(result) == KEYS
        assert result["workers"] == 2 and result["restarts"] == 0
        assert result["peak_pss"] > 0 and result["after_pss"] > 0
    assert "| shuffle + rechunk, s |" in proc.stdout
