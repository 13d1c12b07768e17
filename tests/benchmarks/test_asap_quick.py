"""Smoke test of ``python -m benchmarks asap``: a tiny problem on loopback,
run as a user would run it; checks the records and the figures, never the
timings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client

from benchmarks._testbed import SUBNET
from benchmarks._testbed import testbed as asap_testbed
from benchmarks.asap import default_time_limit, rate_bits, records_table
from dask_lcicomm.testing.netns import gateway_address, unavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "docs" / "results"
KEYS = {"model", "mode", "graph", "degree_budget", "workers", "reached_target", "time_to_target_s",
        "rounds_to_target", "bytes_to_target", "final_loss", "final_accuracy", "max_iteration_gap",
        "spectral_gap", "diameter"}


def test_quick_asap_benchmark_writes_records_and_plots(tmp_path):
    out = tmp_path / "asap.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "asap", "--quick", "--cases", "transient,straggler",
         "--loopback", "--workers", "4",
         "--features", "2048", "--samples", "256", "--rounds", "15", "--straggler-rounds", "8",
         "--compute-ms", "2", "--target-rel", "0.6", "--start-delay", "0.5",
         "--json", str(out), "--plot", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loopback" in proc.stdout and "Targets:" in proc.stdout
    assert re.search(r"testbed RSS [1-9][\d,]* MiB", proc.stderr)
    for path, rounds in ((out, 15), (tmp_path / "asap-straggler.json", 8)):
        records = json.loads(path.read_text())
        assert [r["mode"] for r in records] == ["bsp", "bsp-ring", "async", "asap"]
        for r in records:
            assert set(r) == KEYS
            assert r["workers"] == 4 and 0 < r["final_loss"] < 0.7 and 0 <= r["final_accuracy"] <= 1
            assert r["reached_target"] == (r["time_to_target_s"] is not None)
            if r["reached_target"]:
                # bytes written by then: may be 0 for async, whose local steps alone can do it
                assert 0 < r["rounds_to_target"] <= rounds and r["bytes_to_target"] >= 0
        by_mode = {r["mode"]: r for r in records}
        assert by_mode["bsp"]["final_loss"] == pytest.approx(by_mode["bsp-ring"]["final_loss"], rel=1e-9)
        assert by_mode["bsp"]["spectral_gap"] == 1.0 and by_mode["bsp"]["max_iteration_gap"] <= 1
        assert 0 < by_mode["asap"]["spectral_gap"] < 1
    for case in ("transient", "straggler"):
        for axis in ("time", "bytes"):
            png = tmp_path / f"asap-{case}-loss-{axis}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_asap_per_degree_budget_on_the_mlp(tmp_path):
    """One asap run per degree budget, each on its own graph, in one table,
    one record each and one figure; a budget that misses the target says so."""
    out = tmp_path / "degrees.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "asap", "--loopback", "--workers", "5",
         "--model", "mlp", "--hidden", "32", "--samples", "256", "--degrees", "1,2,4",
         "--cases", "transient", "--rounds", "12", "--compute-ms", "2", "--target-rel", "0.9",
         "--start-delay", "0.5", "--json", str(out), "--plot", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "asap per degree budget" in proc.stdout and "model mlp" in proc.stdout
    records = json.loads(out.read_text())
    assert [(r["mode"], r["degree_budget"], r["model"]) for r in records] == [
        ("asap", 1, "mlp"), ("asap", 2, "mlp"), ("asap", 4, "mlp")]
    gaps = [r["spectral_gap"] for r in records]
    assert gaps[0] < gaps[1] < gaps[2] == 1.0  # degree 4 of 5 workers: all-to-all
    assert records[2]["diameter"] == 1
    for r in records:
        assert set(r) == KEYS and r["reached_target"] == (r["rounds_to_target"] is not None)
    assert ("not reached" in proc.stdout) == (not all(r["reached_target"] for r in records))
    assert (tmp_path / "asap-degrees.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(unavailable() is not None, reason=f"no simulated hosts: {unavailable()}")
def test_testbed_on_simulated_hosts_is_removed_afterwards(tmp_path):
    """Workers in network namespaces with a rate limit, models crossing the
    bridge; afterwards neither the bridge address nor a worker is left."""
    out = tmp_path / "asap.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "asap", "--workers", "3", "--rate", "200mbit",
         "--modes", "bsp,asap", "--cases", "transient", "--features", "2048", "--samples", "256",
         "--rounds", "10", "--compute-ms", "2", "--start-delay", "0.5", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 network namespaces on a bridge, 1 worker(s) each, egress 200mbit per host" in proc.stdout
    records = json.loads(out.read_text())
    assert [r["mode"] for r in records] == ["bsp", "asap"]
    assert records[0]["final_loss"] == pytest.approx(records[1]["final_loss"], rel=0.05)
    addresses = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    assert gateway_address(SUBNET) not in addresses
    workers = subprocess.run(["pgrep", "-f", f"distributed.cli.dask_worker.*{SUBNET[:-5]}"],
                             capture_output=True, text=True).stdout
    assert not workers.strip()


@pytest.mark.parametrize("loopback", [True, False])
def test_testbed_is_removed_when_its_body_is_interrupted(tmp_path, loopback):
    if not loopback and unavailable() is not None:
        pytest.skip(f"no simulated hosts: {unavailable()}")
    with (
        pytest.raises(KeyboardInterrupt),
        asap_testbed(2, "lci", "100mbit", tmp_path, loopback=loopback) as bed,
    ):
        assert bed.workers == 2 and ("loopback" in bed.kind) == loopback
        assert _processes_under(tmp_path)
        raise KeyboardInterrupt
    assert not _processes_under(tmp_path)
    addresses = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    assert gateway_address(SUBNET) not in addresses


def _processes_under(logdir: Path) -> str:
    """Testbed processes whose command line names ``logdir`` (every one does)."""
    return subprocess.run(["pgrep", "-f", str(logdir)], capture_output=True, text=True).stdout.strip()


def test_testbed_workers_get_the_environment_a_nanny_gives(tmp_path):
    """One BLAS thread per worker, as Dask's nanny would set: the workers run
    without one, and a second OpenBLAS thread per worker spins between steps."""
    with asap_testbed(1, "lci", None, tmp_path, loopback=True) as bed, Client(bed.scheduler) as client:
        seen = client.run(lambda: {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")})
    assert list(seen.values()) == [{"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}]


@pytest.mark.parametrize(("rate", "bits"), [("100mbit", 1e8), ("1gbit", 1e9), ("10Gbit", 1e10),
                                            ("500kbit", 5e5), ("2mbps", 1.6e7)])
def test_tc_rates_are_read_in_bits_per_second(rate, bits):
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "100", "100 furlongs", ""])
def test_a_rate_tc_would_not_take_is_refused(rate):
    with pytest.raises(ValueError, match="not a tc rate"):
        rate_bits(rate)


def test_the_default_time_limit_lets_bsp_move_its_rounds_of_models():
    # 32 hosts at 100 mbit, 256 KiB models: 31 of them a round are 0.65 s of egress
    assert default_time_limit(32, 220, 2**18, "100mbit") == pytest.approx(2 * 220 * 31 * 2**21 / 1e8)
    assert default_time_limit(8, 220, 2**18, "100mbit") == 150.0  # the floor
    assert default_time_limit(32, 220, 2**18, None) == 150.0  # loopback: no rate to wait for


def test_asap_runs_make_a_table():
    records = json.loads((RESULTS / "asap" / "asap-quick.json").read_text())
    lines = records_table(records).splitlines()
    assert len(lines) == 2 + len(records)
    assert lines[2].startswith(f"| {records[0]['mode']} |")


def test_asap_counts_read_as_whole_numbers():
    records = json.loads((RESULTS / "asap" / "asap-32-mlp.json").read_text())
    row = records_table(records).splitlines()[2].split(" | ")
    head = list(records[0])
    assert row[head.index("workers")] == "32" and row[head.index("max_iteration_gap")] == "1"
    assert row[head.index("bytes_to_target")] == f"{records[0]['bytes_to_target']:,}"
