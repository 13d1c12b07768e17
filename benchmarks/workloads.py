"""``python -m benchmarks workloads``: the workloads users run (:mod:`benchmarks._workload_suite`)
over each scheme in alternating rounds, on one host and across simulated hosts. What it measures
and why: docs/benchmarks.md, "Workloads"."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
from distributed import Client, LocalCluster

from benchmarks import _runner
from benchmarks._procs import PeerError, expect, receive, spawned
from benchmarks._runner import align, alternated, csv, one_line, progress
from benchmarks._sampler import Sampler, pss
from benchmarks._testbed import testbed
from benchmarks._workload_suite import BY_NAME, WORKLOADS
from benchmarks.comm import SCHEMES
from dask_lcicomm.testing.netns import unavailable

WARM_UP_SIZE = 0.01  # of the untimed run before each workload: imports, first connections
STARTUP_S, STARTUP_PER_WORKER_S = 60.0, 4.0  # for a cluster to start, and more per worker
WORKLOAD_TIMEOUT_S = 300.0  # for one workload and its warm-up, before its round is given up
REQUIRES = {"ucxx": "distributed_ucxx"}  # what a scheme needs beyond our dependencies
SAMPLE_S = 0.1  # between samples of the cluster's memory
#: What is measured around a timed part, in the order :meth:`Meter.timed` measures it.
KEYS = ("seconds", "cpu_seconds", "system_seconds", "minor_faults", "peak_mib", "comm_seconds",
        "upload_seconds", "graph_seconds", "share")
_TICKS = os.sysconf("SC_CLK_TCK")  # per second, in /proc/<pid>/stat


@dataclass(frozen=True)
class Setting:
    name: str
    workers: int
    per_host: int = 0  # workers per simulated host; 0: a LocalCluster on this host
    rate: str | None = None

    def describe(self) -> str:
        if not self.per_host:
            return f"LocalCluster(n_workers={self.workers}, threads_per_worker=1) on one host"
        return (f"{self.workers // self.per_host} simulated hosts x {self.per_host} workers (1 thread, "
                f"nanny), egress {self.rate} each (tc tbf); scheduler and client on a fifth host")

    @property
    def startup_s(self) -> float:
        return STARTUP_S + STARTUP_PER_WORKER_S * self.workers


SETTINGS = (Setting("local-2", 2), Setting("local-16", 16),
            Setting("hosts-10gbit", 8, per_host=2, rate="10gbit"),
            Setting("hosts-1gbit", 8, per_host=2, rate="1gbit"))
_SETTING = {s.name: s for s in SETTINGS}


def worker_comm_seconds(dask_worker: Any) -> float:
    """On a worker: its seconds in transfers so far, by Dask's fine performance metrics."""
    return sum(value for key, value in dask_worker.digests_total.items()
               if isinstance(key, tuple) and key[-1:] == ("seconds",)
               and ((key[0] == "gather-dep" and key[1] in ("network", "deserialize", "decompress"))
                    or (key[0] == "p2p" and len(key) == 5 and key[2] == "background-comms"
                        and key[3] in ("send", "serialize", "compress"))))


def upload_seconds(events: Sequence[tuple[float, dict[str, Any]]], sent: Sequence[float]) -> float:
    """Seconds from handing each graph to the client's comm (times ``sent``) to the scheduler
    starting on it, by its ``update-graph`` ``events`` (it has read the message then, and not
    yet unpickled the graph): the uploads, on one host's clock."""
    if not sent:
        return 0.0
    started = sorted(
        message["metrics"]["start_timestamp_seconds"] for _, message in events
        if message.get("action") == "update-graph" and "metrics" in message
        and message["metrics"]["start_timestamp_seconds"] >= sent[0])[: len(sent)]
    if len(started) < len(sent):
        raise RuntimeError(f"the scheduler started on {len(started)} of {len(sent)} graphs")
    return sum(start - at for at, start in zip(sent, started, strict=True))


class Meter:
    """Measures a timed part on ``client``'s cluster: this process, the scheduler's, the workers'
    and their parents (the nannies' processes; this one for a ``LocalCluster``)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        workers = set(client.run(os.getpid).values())
        self.pids = {os.getpid(), client.run_on_scheduler(os.getpid), *workers}
        for pid in workers:
            with suppress(psutil.Error):
                self.pids.add(psutil.Process(pid).ppid())
        self.pids -= {0, 1}
        self.last: dict[str, float] | None = None
        #: When the client handed each graph to its comm (wall clock, as the scheduler's events).
        self.graphs_sent: list[float] = []
        send = client._send_to_scheduler

        def recording(msg: dict[str, Any]) -> None:
            if msg.get("op") == "update-graph":
                self.graphs_sent.append(time.time())
            send(msg)

        client._send_to_scheduler = recording

    def _counters(self) -> list[float]:
        """CPU seconds, system seconds and minor faults, summed over the processes."""
        totals = [0.0, 0.0, 0.0]
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    # After the command's ")": minflt is the 8th field, utime and stime the 12th, 13th.
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            user, kernel = int(fields[11]) / _TICKS, int(fields[12]) / _TICKS
            totals = [totals[0] + user + kernel, totals[1] + kernel, totals[2] + int(fields[7])]
        return totals

    def _comm(self) -> list[float]:
        """The workers' mean seconds in transfers, and the scheduler's in turning graphs into
        tasks (unpickling, materialising, ordering: no communication, kept for reference)."""
        per_worker = self.client.run(worker_comm_seconds)
        graph = self.client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.digests_total.get("update-graph-duration", 0.0))
        return [sum(per_worker.values()) / max(len(per_worker), 1), float(graph)]

    @contextmanager
    def timed(self) -> Iterator[None]:
        comm_before, counters_before = self._comm(), self._counters()  # no RPC in the window
        self.graphs_sent.clear()
        with Sampler(lambda: (pss(self.pids),), SAMPLE_S) as sampler:
            start = time.perf_counter()
            yield
            seconds = time.perf_counter() - start
        cpu, system, faults = (b - a for a, b in zip(counters_before, self._counters(), strict=True))
        comm, graph = (b - a for a, b in zip(comm_before, self._comm(), strict=True))
        upload = upload_seconds(self.client.get_events(self.client.id), list(self.graphs_sent))
        share = min(1.0, (comm + upload) / seconds) if seconds > 0 else 0.0
        values = (seconds, cpu, system, faults, sampler.peak()[0] / 2**20, comm, upload, graph, share)
        self.last = {k: round(v, 4) for k, v in zip(KEYS, values, strict=True)}


def driver_main(conn: Connection, scheme: str, setting: Setting, address: str | None,
                names: list[str], size: float, repeat: int) -> None:
    """Child process: holds the client (and, without ``address``, the ``LocalCluster``), runs the
    workloads and sends a record of each timed run or error, then the links lci ran over."""
    from benchmarks._cluster import link_providers

    # The scheduler logs every p2p shuffle's start and end at warning level.
    logging.getLogger("distributed.shuffle._scheduler_plugin").setLevel(logging.ERROR)
    with ExitStack() as stack:
        client = stack.enter_context(Client(address or stack.enter_context(LocalCluster(
            protocol=scheme, n_workers=setting.workers, threads_per_worker=1,
            dashboard_address=":0"))))
        client.wait_for_workers(setting.workers, timeout=setting.startup_s)
        meter = Meter(client)
        conn.send(("ready", None))
        for name in names:
            try:
                BY_NAME[name].run(client, WARM_UP_SIZE, meter.timed)
                for index in range(repeat):
                    meter.last = None
                    BY_NAME[name].run(client, size, meter.timed)
                    if meter.last is None:
                        raise RuntimeError(f"{name} timed nothing")
                    conn.send(("record", {"workload": name, **meter.last, "run": index}))
            except Exception as exc:
                conn.send(("record", {"workload": name, "error": one_line(exc)}))
        conn.send(("links", link_providers(client) if scheme == "lci" else None))


def _one_round(setting: Setting, scheme: str, round_index: int, names: list[str], size: float,
               repeat: int, logdir: Path) -> list[dict[str, Any]]:
    """Each workload's timed runs on a fresh cluster; errors become records, and lci's records
    name the providers its processes' links ran over."""
    base = {"setting": setting.name, "scheme": scheme, "round": round_index}
    records: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            address = None  # the driver starts a LocalCluster
            if setting.per_host:
                address = stack.enter_context(testbed(
                    setting.workers, scheme, setting.rate, logdir, per_host=setting.per_host,
                    worker_options=("--memory-limit", "auto"))).scheduler
            driver = stack.enter_context(spawned(driver_main, scheme, setting, address, names, size,
                                                 repeat, name=f"{scheme}-{setting.name}", daemon=False))
            expect(driver, "ready", setting.startup_s + 30)
            while (message := receive(driver, WORKLOAD_TIMEOUT_S))[0] == "record":
                r = {**base, **message[1]}
                what = r["error"] if "error" in r else f"{r['seconds']:.2f} s"
                row = row_name(r["workload"], r.get("run", 0))
                progress(f"  {setting.name} r{round_index + 1} {scheme:>5} {row:<19} {what}")
                records.append(r)
    except (PeerError, RuntimeError, OSError) as exc:
        seen = {r["workload"] for r in records}
        return records + [{**base, "workload": name, "error": str(exc).splitlines()[0]}
                          for name in names if name not in seen]
    return [{**r, "links": message[1]} if message[1] else r for r in records]


def row_name(workload: str, run: int) -> str:
    """A workload's first run on a cluster has a row, the warm runs after it another."""
    return f"{workload} warm" if run else workload


def medians(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """``[setting][row][scheme][key]``: each value's median over the runs that succeeded."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in (r for r in records if "error" not in r):
        grouped.setdefault((r["setting"], row_name(r["workload"], r.get("run", 0)), r["scheme"]),
                           []).append(r)
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for (setting, row, scheme), rs in grouped.items():
        out.setdefault(setting, {}).setdefault(row, {})[scheme] = {
            key: statistics.median(r[key] for r in rs) for key in KEYS if all(key in r for r in rs)
        } | {"runs": len(rs)}
    return out


def geomean(values: Sequence[float]) -> float | None:
    return statistics.geometric_mean(values) if values else None


def format_setting(setting: Setting, per_workload: dict[str, dict[str, dict[str, float]]],
                   schemes: Sequence[str]) -> str:
    """A row per workload, its first runs then its warm runs, and a geometric mean of each; "-"
    where a value is missing (a scheme's failures, a run saved before the value was measured)."""
    others = [s for s in schemes if s != "lci"]
    rows = [["workload", *(f"{s} s" for s in schemes), *(f"lci/{s}" for s in others), "tcp comm",
             "tcp upload", "1-share", "cpu lci/tcp", "faults lci/tcp", "peak lci/tcp"]]
    ratios: dict[tuple[int, str], list[float]] = {}

    def cell(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    def lci_over(m: dict[str, dict[str, float]], key: str, scheme: str) -> float | None:
        under = m.get(scheme, {}).get(key, 0.0)
        return m["lci"][key] / under if under > 0 and key in m.get("lci", {}) else None

    for run, w in itertools.product((0, 1), WORKLOADS):
        if not (m := per_workload.get(row_name(w.name, run), {})):
            continue
        over = [lci_over(m, "seconds", s) for s in others]
        for s, ratio in zip(others, over, strict=True):
            if ratio is not None:
                ratios.setdefault((run, s), []).append(ratio)
        tcp = m.get("tcp")
        shares = [tcp[k] / tcp["seconds"] if tcp and k in tcp else None
                  for k in ("comm_seconds", "upload_seconds")]
        rows.append([row_name(w.name, run), *(cell(m.get(s, {}).get("seconds")) for s in schemes),
                     *map(cell, over), *(cell(share, ".0%") for share in shares),
                     cell(1 - tcp["share"] if tcp else None),
                     *(cell(lci_over(m, k, "tcp")) for k in ("cpu_seconds", "minor_faults", "peak_mib"))])
    for run in sorted({run for run, _ in ratios}):
        rows.append([row_name("geometric mean", run), *[""] * len(schemes),
                     *(cell(geomean(ratios.get((run, s), []))) for s in others), *[""] * 6])
    return "\n".join([f"{setting.name}: {setting.describe()}", *align(rows, 1, rules=())])


def report_page(data: dict[str, Any]) -> str:
    """A saved run as Markdown (the docs' pages): how it was run, then each setting's table."""
    env = data["environment"]
    argv = " ".join(["python -m benchmarks", *env["argv"][1:]])
    lines = [
        f"- command: `{argv}`, {data['rounds']} rounds, {data.get('repeat', 1)} timed run(s) of "
        f"each workload per cluster, size {data['size']:g}",
        f"- when: {env['timestamp']}; code: `{env['source']}`; took {data['seconds']:,} s",
        f"- machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB; "
        f"Python {env['python']}, distributed {env['distributed']}", ""]
    for s in data["settings"]:
        table = format_setting(Setting(**s), data["medians"].get(s["name"], {}), data["schemes"])
        lines += ["```text", table, "```", ""]
    errors = Counter((r["setting"], r["scheme"], r["error"]) for r in data["records"] if "error" in r)
    lines += [f"- {count} records failed in {setting} over {scheme}: {error}"
              for (setting, scheme, error), count in errors.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _runner.parser("workloads", __doc__, (), "3, or 1 with --quick", baseline=False, plot=False)
    add = parser.add_argument
    add("--settings", type=_runner.subset(_SETTING), help=f"default: {','.join(_SETTING)}")
    add("--schemes", type=csv, default=list(SCHEMES),
        help=f"default: {','.join(SCHEMES)}; one not installed is left out")
    add("--workloads", type=_runner.subset(BY_NAME), help=f"default: {','.join(BY_NAME)}")
    add("--size", type=float, help="data scale, default 1.0 (0.05 with --quick)")
    add("--repeat", type=_runner.positive, default=1,
        help="timed runs of each workload per cluster, default 1; the runs after the first are warm")
    args = parser.parse_args(argv)
    names = args.workloads or list(BY_NAME)
    chosen = args.settings or (["local-2"] if args.quick else list(_SETTING))
    settings = [_SETTING[s] for s in chosen]
    if any(s.per_host for s in settings) and (why := unavailable()) is not None:
        progress(f"simulated hosts left out: {why}")
        settings = [s for s in settings if not s.per_host]
    schemes = [s for s in args.schemes
               if s not in REQUIRES or importlib.util.find_spec(REQUIRES[s]) is not None]
    rounds = args.rounds or (1 if args.quick else 3)
    size = args.size or (0.05 if args.quick else 1.0)
    data: dict[str, Any] = {
        "command": "workloads", "environment": _runner.environment_facts(),  # its load average: the run's
        "settings": [asdict(s) for s in settings], "schemes": schemes, "rounds": rounds,
        "repeat": args.repeat, "size": size, "complete": False, "seconds": 0, "records": [],
        "medians": {}, "sources": {w.name: w.source for w in WORKLOADS}}
    started = time.monotonic()

    def update(complete: bool = False) -> None:
        """The JSON is written after every round: a run stopped half-way keeps what it measured."""
        data.update(complete=complete, seconds=round(time.monotonic() - started),
                    medians=medians(data["records"]))
        if args.json:
            _runner.write_json(args.json, data, indent=1)

    with tempfile.TemporaryDirectory(prefix="workloads-") as logdir:
        for setting in settings:
            for round_index, scheme in alternated(schemes, rounds):
                begun = time.monotonic()
                data["records"] += _one_round(setting, scheme, round_index, names, size,
                                              args.repeat, Path(logdir))
                progress(f"{setting.name} round {round_index + 1}/{rounds} {scheme}: "
                         f"{time.monotonic() - begun:.0f} s")
                update()
    update(complete=True)
    print(report_page(data), end="")
    if left_out := sorted(set(args.schemes) - set(schemes)):
        print(f"- not installed, left out: {', '.join(left_out)}")
    return 1 if any("error" in r for r in data["records"]) else 0
