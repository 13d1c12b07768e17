"""Smoke test for ``python -m benchmarks.peer_cost``: every configuration
measured or skipped with its reason, and the numbers are per-peer costs a
process can have (no thresholds: what they are is the benchmark's answer)."""

from __future__ import annotations

import json
import subprocess
import sys

from _cli import REPO_ROOT


def test_peer_cost_measures_each_configuration(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_cost", "--peers", "6", "--servers", "2",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"tcp", "ucxx", "lci", "lci-tcp", "lci-ucx", "lci-ofi"}
    for name in ("tcp", "lci", "lci-tcp"):
        result = data["results"][name]
        # every comm holds at least its own descriptor (a socket, or the
        # shm device's Unix socket)
        assert result["fds_per_peer"] >= 1, (name, result)
        assert result["rss_mib_per_peer"] > -1, (name, result)
        assert f"| {name} |" in proc.stdout
    for name in ("ucxx", "lci-ucx", "lci-ofi"):
        result = data["results"][name]
        assert "fds_per_peer" in result or "not installed" in result["skipped"]


def test_peer_cost_refuses_unknown_configurations():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_cost", "--configs", "tcp,nope"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "nope" in proc.stderr
