"""``python -m benchmarks workloads``: the workloads users run (:mod:`benchmarks._workload_suite`)
over each scheme in alternating rounds, on one host and across simulated hosts. What it measures
and why: docs/benchmarks.md, "Workloads"."""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks import _runner, comm
from benchmarks._cluster import cluster_answers, link_providers
from benchmarks._contenders import Configuration
from benchmarks._runner import Benchmark, Metric, Record, align, one_line, progress
from benchmarks._sampler import Sampler, pss
from benchmarks._testbed import testbed
from benchmarks._workload_suite import BY_NAME
from dask_lcicomm.testing.netns import unavailable

WARM_UP_SIZE = 0.01  # of the untimed run before each workload: imports, first connections
STARTUP_S, STARTUP_PER_WORKER_S = 60.0, 4.0  # for a cluster to start, and more per worker
WORKLOAD_TIMEOUT_S = 300.0  # for one workload and its warm-up, before its round is given up
SAMPLE_S = 0.1  # between samples of the cluster's memory
#: What is measured around a timed part, in the order :meth:`Meter.timed` measures it.
METRICS = tuple(Metric(key, unit, False) for key, unit in (
    ("seconds", "s"), ("cpu_seconds", "s"), ("system_seconds", "s"), ("minor_faults", "faults"),
    ("peak_mib", "MiB"), ("comm_seconds", "s"), ("upload_seconds", "s"), ("graph_seconds", "s"),
    ("share", "of the time")))
KEYS = tuple(m.key for m in METRICS)
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


SETTINGS = {s.name: s for s in (Setting("local-2", 2), Setting("local-16", 16),
                                Setting("hosts-10gbit", 8, per_host=2, rate="10gbit"),
                                Setting("hosts-1gbit", 8, per_host=2, rate="1gbit"))}


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload in a setting: its first timed run on a cluster, or (``warm``) the runs after."""

    name: str
    setting: Setting
    workload: str
    source: str  # the coiled/benchmarks test it is modelled on
    warm: bool = False
    timeout_s: float = WORKLOAD_TIMEOUT_S


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


#: The cluster child's one meter: it wraps the client's sending.
_meter = functools.cache(Meter)


#: In a cluster child: why each workload that failed did; its later runs are not made.
_FAILED: dict[str, str] = {}


def answer_workload(size: float, links: bool, client: Any, spec: WorkloadSpec) -> tuple[str, str, Any]:
    """Cluster child: a timed run of the workload (its first on the cluster after an untimed one
    at a tiny size); what was measured and, with ``links``, the providers lci's links ran over."""
    meter, workload = _meter(client), BY_NAME[spec.workload]
    try:
        if spec.workload in _FAILED:
            raise RuntimeError(f"an earlier run failed: {_FAILED[spec.workload]}")
        if not spec.warm:
            workload.run(client, WARM_UP_SIZE, meter.timed)
        meter.last = None
        workload.run(client, size, meter.timed)
        if meter.last is None:
            raise RuntimeError(f"{spec.workload} timed nothing")
    except Exception as exc:
        _FAILED.setdefault(spec.workload, one_line(exc))
        return ("error", spec.name, one_line(exc))
    return ("result", spec.name, (meter.last, link_providers(client) if links else None))


def run_round(size: float, c: Configuration, benches: list[Benchmark], index: int,
              record: Callable[[Record], None]) -> None:
    """One setting's workloads on a fresh cluster, each's first run followed by its warm runs;
    lci's records name the providers its processes' links ran over."""
    setting: Setting = benches[0].spec.setting
    specs = [b.spec for b in benches for _ in range(b.runs)]

    def answers() -> Iterator[tuple[WorkloadSpec, Any]]:
        with ExitStack() as stack:
            address = None  # the cluster child starts a LocalCluster
            if setting.per_host:
                logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="workloads-")))
                address = stack.enter_context(testbed(
                    setting.workers, c.scheme, setting.rate, logdir, per_host=setting.per_host,
                    worker_options=("--memory-limit", "auto"))).scheduler
            yield from cluster_answers(c, functools.partial(answer_workload, size, c.scheme == "lci"),
                                       specs, n_workers=setting.workers, address=address,
                                       startup_s=STARTUP_S + STARTUP_PER_WORKER_S * setting.workers)

    _runner.record_answers(c.label, index, specs, answers(), record, lambda _, answer: (
        answer[0], {"links": answer[1]} if answer[1] else {}))


def geomean(values: Sequence[float]) -> float | None:
    return statistics.geometric_mean(values) if values else None


def format_setting(data: dict[str, Any], setting: dict[str, Any]) -> str:
    """A row per workload, its first runs then its warm runs, and a geometric mean of each; "-"
    where a value is missing (a scheme's failures, a run saved before the value was measured)."""
    schemes = [label for label, status in data["status"].items() if status["available"]]
    others = [s for s in schemes if s != "lci"]
    medians = {(r["benchmark"], r["metric"]): r["per_configuration"] for r in data["results"]}
    rows = [["workload", *(f"{s} s" for s in schemes), *(f"lci/{s}" for s in others), "tcp comm",
             "tcp upload", "1-share", "cpu lci/tcp", "faults lci/tcp", "peak lci/tcp"]]
    ratios: dict[tuple[bool, str], list[float]] = {}

    def cell(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    def median(bench: str, key: str, scheme: str) -> float | None:
        return medians.get((bench, key), {}).get(scheme, {}).get("median")

    def lci_over(bench: str, key: str, scheme: str) -> float | None:
        under, over = median(bench, key, scheme), median(bench, key, "lci")
        return over / under if under and over is not None else None

    benches = [b for b in data["config"]["benchmarks"] if b["setting"] == setting]
    for b in sorted(benches, key=lambda b: b["warm"]):
        name, row = b["name"], f"{b['workload']} warm" if b["warm"] else b["workload"]
        if all(median(name, "seconds", s) is None for s in schemes):
            continue
        over = [lci_over(name, "seconds", s) for s in others]
        for s, ratio in zip(others, over, strict=True):
            if ratio is not None:
                ratios.setdefault((b["warm"], s), []).append(ratio)
        tcp = {key: median(name, key, "tcp") for key in KEYS}
        shares = [part / tcp["seconds"] if tcp["seconds"] and (part := tcp[k]) is not None else None
                  for k in ("comm_seconds", "upload_seconds")]
        rows.append([row, *(cell(median(name, "seconds", s)) for s in schemes), *map(cell, over),
                     *(cell(share, ".0%") for share in shares),
                     cell(None if tcp["share"] is None else 1 - tcp["share"]),
                     *(cell(lci_over(name, k, "tcp")) for k in ("cpu_seconds", "minor_faults", "peak_mib"))])
    for warm in sorted({warm for warm, _ in ratios}):
        rows.append(["geometric mean warm" if warm else "geometric mean", *[""] * len(schemes),
                     *(cell(geomean(ratios.get((warm, s), []))) for s in others), *[""] * 6])
    return "\n".join([f"{setting['name']}: {Setting(**setting).describe()}", *align(rows, 1, rules=())])


def report_page(data: dict[str, Any]) -> str:
    """A saved run as Markdown (the docs' pages): how it was run, then each setting's table."""
    env, config = data["environment"], data["config"]
    argv = " ".join(["python -m benchmarks", *env["argv"][1:]])
    lines = [
        f"- command: `{argv}`, {config['rounds']} rounds, {config['repeat']} timed run(s) of "
        f"each workload per cluster, size {config['size']:g}",
        f"- when: {env['timestamp']}; code: `{env['source']}`; took {data['seconds']:,} s",
        f"- machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB; "
        f"Python {env['python']}, distributed {env['distributed']}", ""]
    settings = {b["setting"]["name"]: b["setting"] for b in config["benchmarks"]}
    for setting in settings.values():
        lines += ["```text", format_setting(data, setting), "```", ""]
    setting_of = {b["name"]: b["setting"]["name"] for b in config["benchmarks"]}
    errors = Counter((setting_of[r["benchmark"]], r["configuration"], r["error"])
                     for r in data["raw"] if r["error"])
    lines += [f"- {count} records failed in {setting} over {scheme}: {error}"
              for (setting, scheme, error), count in errors.items()]
    lines += [f"- {label}: {status['label']} ({status['detail']})"
              for label, status in data["status"].items() if not status["available"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _runner.parser("workloads", __doc__, (), "3, or 1 with --quick", baseline=False)
    add = parser.add_argument
    add("--settings", type=_runner.subset(SETTINGS), help=f"default: {','.join(SETTINGS)}")
    add("--schemes", type=_runner.csv, default=list(comm.SCHEMES),
        help=f"default: {','.join(comm.SCHEMES)}; one not installed shows as such")
    add("--workloads", type=_runner.subset(BY_NAME), help=f"default: {','.join(BY_NAME)}")
    add("--size", type=float, help="data scale, default 1.0 (0.05 with --quick)")
    add("--repeat", type=_runner.positive, default=1,
        help="timed runs of each workload per cluster, default 1; the runs after the first are warm")
    args = parser.parse_args(argv)
    settings = [SETTINGS[s] for s in args.settings or (["local-2"] if args.quick else SETTINGS)]
    if any(s.per_host for s in settings) and (why := unavailable()) is not None:
        progress(f"simulated hosts left out: {why}")
        settings = [s for s in settings if not s.per_host]
    size = args.size or (0.05 if args.quick else 1.0)
    benches = [Benchmark(WorkloadSpec(f"{s.name}-{w}{'-warm' if warm else ''}", s, w, BY_NAME[w].source,
                                      warm), METRICS, s.name, runs)
               for s in settings for w in args.workloads or BY_NAME
               for warm, runs in ((False, 1), (True, args.repeat - 1)) if runs]
    pairs, config = comm.ratio_pairs(args.schemes), {"size": size, "repeat": args.repeat}

    def save(result: _runner.Run) -> None:
        """After every round: a run stopped half-way keeps what it measured."""
        if args.json:
            _runner.write_json(args.json, _runner.to_json(result, pairs, **config))

    result = _runner.run("workloads", [Configuration.of_scheme(s) for s in args.schemes], benches,
                         args.rounds or (1 if args.quick else 3), args.quick,
                         functools.partial(run_round, size), stage=lambda b: b.kind, after_round=save)
    data = _runner.to_json(result, pairs, **config)
    return _runner.finish(args, report_page(data), data)
