"""``python -m benchmarks workloads``: the real CLI once in ``--quick`` (every
workload, lci and tcp, on a 2-worker LocalCluster), once across simulated
hosts where namespaces can be made, and its measuring and reporting parts on
their own. No timing assertions: the CI machines are noisy."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from _cli import REPO_ROOT, run_cli

from benchmarks._contenders import Configuration, Status
from benchmarks._runner import Benchmark, Record, Run, to_json
from benchmarks._workload_suite import WORKLOADS, WrongResult, check
from benchmarks.report import command_table
from benchmarks.workloads import (
    KEYS,
    METRICS,
    SETTINGS,
    WorkloadSpec,
    format_setting,
    geomean,
    report_page,
    upload_seconds,
    worker_comm_seconds,
)
from dask_lcicomm.testing.netns import remove_left_behind, unavailable

NAMES = [w.name for w in WORKLOADS]
SAVED = sorted((REPO_ROOT / "docs" / "results" / "workloads").glob("*.json"))


def records(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each timed run's record: its raw entry with its values, which the JSON keeps in the
    rounds of each metric (in the order of the raw entries)."""
    rounds = {(r["benchmark"], r["metric"]): r["per_configuration"] for r in data["results"]}
    seen: dict[tuple[str, str], int] = {}
    out = []
    for raw in data["raw"]:
        index = seen[raw["benchmark"], raw["configuration"]] = seen.get(
            (raw["benchmark"], raw["configuration"]), -1) + 1
        out.append(raw | {key: rounds[raw["benchmark"], key][raw["configuration"]]["rounds"][index]
                          for key in KEYS})
    return out


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("workloads") / "workloads.json"
    return run_cli(["workloads", "--quick", "--schemes", "lci,tcp"], out, timeout_s=300,
                   plot=False)


def test_every_workload_measured_on_each_scheme(quick_run: dict[str, Any]) -> None:
    proc, data = quick_run["proc"], quick_run["data"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(NAMES) >= 10
    seen = {(r["configuration"], r["benchmark"]) for r in data["raw"] if r["error"] is None}
    assert seen == {(s, f"local-2-{n}") for s in ("lci", "tcp") for n in NAMES}
    assert data["complete"] and len(data["raw"]) == 2 * len(NAMES)
    for r in records(data):
        assert r["seconds"] > 0 and r["cpu_seconds"] > 0 and r["peak_mib"] > 0
        assert 0 <= r["system_seconds"] <= r["cpu_seconds"] and r["minor_faults"] > 0
        assert 0 <= r["share"] <= 1 and 0 <= r["upload_seconds"] <= r["seconds"]
    benchmarks = data["config"]["benchmarks"]
    assert {b["workload"]: b["source"] for b in benchmarks} == {w.name: w.source for w in WORKLOADS}


def test_lci_ran_over_shared_memory(quick_run: dict[str, Any]) -> None:
    lci = [r for r in quick_run["data"]["raw"] if r["configuration"] == "lci"]
    for links in {str(r["links"]) for r in lci}:
        assert "shm" in links and "tcp" not in links, links


def test_data_moving_workloads_show_communication(quick_run: dict[str, Any]) -> None:
    """The metrics are read: workloads that move data between workers have
    communication time, counted from the workers' digests."""
    by_name = {r["benchmark"].removeprefix("local-2-"): r for r in records(quick_run["data"])
               if r["configuration"] == "tcp"}
    for name in ("rechunk-tasks", "shuffle-p2p", "join-p2p"):
        assert by_name[name]["comm_seconds"] > 0, name
    for name in NAMES:  # every workload sends the scheduler at least one graph
        assert by_name[name]["upload_seconds"] > 0, name


def test_table_has_every_workload_and_a_geometric_mean(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    for name in NAMES:
        assert f"\n{name} " in stdout, name
    assert "lci/tcp" in stdout and "geometric mean" in stdout


@pytest.mark.skipif(unavailable() is not None, reason=f"no simulated hosts: {unavailable()}")
def test_across_simulated_hosts_lci_uses_shm_inside_and_tcp_between(tmp_path) -> None:
    out = tmp_path / "hosts.json"
    got = run_cli(["workloads", "--quick", "--settings", "hosts-1gbit", "--schemes", "lci",
                   "--workloads", "rechunk-p2p", "--repeat", "2"], out, timeout_s=300, plot=False)
    assert got["proc"].returncode == 0, got["proc"].stderr[-3000:]
    first, warm = records(got["data"])
    assert f"{first['benchmark']}-warm" == warm["benchmark"] == "hosts-1gbit-rechunk-p2p-warm"
    assert warm["seconds"] > 0
    assert "rechunk-p2p warm" in got["proc"].stdout
    workers = {k: v for k, v in first["links"].items() if k != "scheduler"}
    assert len(workers) == 8
    for providers in workers.values():
        assert providers == ["shm", "tcp"], first["links"]


def test_worker_comm_seconds_counts_transfers_only() -> None:
    worker = SimpleNamespace(digests_total={
        ("gather-dep", "network", "seconds"): 1.0,
        ("gather-dep", "deserialize", "seconds"): 0.5,
        ("gather-dep", "network", "count"): 7.0,
        ("gather-dep", "other", "seconds"): 9.0,
        ("p2p", "span", "background-comms", "send", "seconds"): 2.0,
        ("p2p", "span", "background-comms", "idle", "seconds"): 9.0,
        ("p2p", "span", "foreground", "send", "seconds"): 9.0,
        ("execute", "x", "thread-cpu", "seconds"): 9.0,
        "latency": 9.0,
    })
    assert worker_comm_seconds(worker) == 3.5


def test_upload_seconds_pairs_each_graph_sent_with_the_start_that_follows_it() -> None:
    def started(at: float) -> tuple[float, dict[str, Any]]:
        return at + 1, {"action": "update-graph", "metrics": {"start_timestamp_seconds": at}}

    events = [started(9.0), (10.1, {"action": "add-worker"}), started(10.5), started(11.2),
              (11.5, {"action": "update-graph", "status": "error"}), started(12.0)]
    # 9.0 precedes the first graph sent; 12.0 is a later graph's.
    assert math.isclose(upload_seconds(events, [10.0, 11.0]), 0.5 + 0.2)
    assert upload_seconds(events, []) == 0.0
    with pytest.raises(RuntimeError, match="1 of 2 graphs"):
        upload_seconds(events[:3], [10.0, 11.0])


def _record(scheme: str, workload: str, seconds: float, round_index: int = 0,
            warm: bool = False) -> Record:
    """A timed run without page faults, as runs saved before they were counted."""
    values = {"seconds": seconds, "cpu_seconds": seconds, "peak_mib": 100.0,
              "comm_seconds": seconds / 4, "upload_seconds": 0.0, "graph_seconds": 0.0, "share": 0.25}
    return Record(f"local-2-{workload}{'-warm' if warm else ''}", scheme, round_index,
                  dict.fromkeys(KEYS) | values)


def _run(records: list[Record]) -> dict[str, Any]:
    """The JSON of a run of array-sum and align at local-2, first and warm runs, with ``records``."""
    setting = SETTINGS["local-2"]
    benches = [Benchmark(WorkloadSpec(f"local-2-{w}{'-warm' if warm else ''}", setting, w, "", warm),
                         METRICS, setting.name) for w in ("array-sum", "align") for warm in (False, True)]
    schemes = ("lci", "tcp")
    run = Run("workloads", tuple(map(Configuration.of_scheme, schemes)), tuple(benches), 3, False,
              {s: Status(True, "ok") for s in schemes}, records)
    return to_json(run, [("lci", "tcp")], size=1.0, repeat=3)


def _median(data: dict[str, Any], benchmark: str, key: str, scheme: str) -> float:
    return next(r["per_configuration"][scheme]["median"] for r in data["results"]
                if (r["benchmark"], r["metric"]) == (benchmark, key))


def test_medians_skip_errors_and_ratios_form_a_geometric_mean() -> None:
    data = _run([
        _record("tcp", "array-sum", 2.0), _record("tcp", "array-sum", 4.0, 1),
        _record("tcp", "array-sum", 3.0, 2), _record("lci", "array-sum", 1.5),
        Record("local-2-array-sum", "lci", 1, error="boom"),
        _record("tcp", "align", 1.0), _record("lci", "align", 2.0),
    ])
    assert _median(data, "local-2-array-sum", "seconds", "tcp") == 3.0
    assert _median(data, "local-2-array-sum", "seconds", "lci") == 1.5
    text = format_setting(data, asdict(SETTINGS["local-2"]))
    assert "0.50" in text and "2.00" in text  # lci/tcp of each
    # Records without page faults (runs saved before they were counted): no ratio.
    assert text.splitlines()[2].split()[8] == "-"
    assert text.splitlines()[-1].split()[-1] == "1.00"  # sqrt(0.5 * 2)
    assert "warm" not in text  # no warm run, no warm row
    assert math.isclose(geomean([0.5, 2.0]) or 0, 1.0)
    assert geomean([]) is None


def test_warm_runs_have_rows_and_a_geometric_mean_of_their_own() -> None:
    data = _run([
        _record("tcp", "align", 1.0), _record("lci", "align", 2.0),
        _record("tcp", "align", 1.0, warm=True), _record("tcp", "align", 3.0, warm=True),
        _record("lci", "align", 1.0, warm=True), _record("lci", "align", 1.0, warm=True),
    ])
    assert _median(data, "local-2-align", "seconds", "lci") == 2.0
    # Runs 1 and 2 together; of an even count the worse middle value, as every command's.
    assert _median(data, "local-2-align-warm", "seconds", "tcp") == 3.0
    lines = format_setting(data, asdict(SETTINGS["local-2"])).splitlines()
    rows = {line.split("  ")[0].strip(): line.split() for line in lines[2:]}
    assert rows["align"][3] == "2.00" and rows["align warm"][4] == "0.33"
    assert rows["geometric mean"][-1] == "2.00"
    assert rows["geometric mean warm"][-1] == "0.33"


@pytest.mark.skipif(unavailable() is not None, reason=f"no simulated hosts: {unavailable()}")
def test_across_simulated_hosts_a_ucxx_client_reaches_the_scheduler_over_the_bridge(
        tmp_path) -> None:
    """UCX leaves bridge devices out unless the testbed lets it use them: the
    client and scheduler in the root namespace then fail every connection. And
    a UCX context knows only the devices there were when it was made: two
    rounds, each on a testbed (a bridge) of its own, show that no process
    outlives its round's bridge with a UCX context in it."""
    pytest.importorskip("distributed_ucxx")
    out = tmp_path / "hosts-ucxx.json"
    got = run_cli(["workloads", "--quick", "--settings", "hosts-10gbit", "--schemes", "ucxx",
                   "--workloads", "submit-result", "--rounds", "2"], out, timeout_s=400,
                  plot=False)
    assert got["proc"].returncode == 0, got["proc"].stdout[-3000:] + got["proc"].stderr[-3000:]
    runs = records(got["data"])
    assert [r["round"] for r in runs] == [0, 1]
    for record in runs:
        assert record["error"] is None and record["seconds"] > 0, record


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _started(runner: psutil.Process, marker: str) -> list[psutil.Process]:
    """The runner's descendants whose command line has ``marker`` in it."""
    found = []
    for proc in runner.children(recursive=True):
        try:
            if marker in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.mark.skipif(unavailable() is not None, reason=f"no simulated hosts: {unavailable()}")
def test_a_sigterm_removes_the_simulated_hosts_and_every_process_of_the_run() -> None:
    """As Ctrl-C does: a batch system's time limit or ``kill`` must not leave
    namespaces, bridges and Dask processes behind. The signal comes once the
    workers joined and the process that runs the workloads started."""
    before = _namespaces()
    made: set[str] = set()
    started: list[psutil.Process] = []
    runner = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "workloads", "--settings", "hosts-10gbit",
         "--schemes", "tcp", "--workloads", "large-map", "--rounds", "3", "--size", "0.05"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        process = psutil.Process(runner.pid)
        deadline = time.monotonic() + 180
        while (not _started(process, "spawn_main") and runner.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.5)
        made = _namespaces() - before
        started = process.children(recursive=True)
        workers = _started(process, "distributed.cli.dask_worker")
        assert len(workers) == 8 and len(made) == 4, (made, runner.poll())
        runner.send_signal(signal.SIGTERM)
        _, stderr = runner.communicate(timeout=90)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        left = made & _namespaces()
        _, alive = psutil.wait_procs(started, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        remove_left_behind(left)
    assert runner.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr
    assert not left and not alive, (left, alive)


def test_a_wrong_result_raises() -> None:
    check(True, "fine")
    with pytest.raises(WrongResult, match="row sums"):
        check(False, "row sums")


def test_a_saved_run_renders_as_a_page_of_the_docs(quick_run: dict[str, Any]) -> None:
    page = report_page(quick_run["data"])
    assert page in quick_run["proc"].stdout  # what the run printed
    assert "python -m benchmarks workloads" in page
    assert page.count("```text") == 1 and "local-2:" in page and "geometric mean" in page


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_report_renders_every_saved_run_as_the_run_printed_it(path) -> None:
    data = json.loads(path.read_text())
    page = command_table(data)
    assert page == report_page(data)
    settings = {b["setting"]["name"] for b in data["config"]["benchmarks"]}
    assert page.count("```text") == len(settings) <= page.count("\ngeometric mean ")
    for record in records(data):
        if record["error"] is None:
            assert record["seconds"] > 0, record
