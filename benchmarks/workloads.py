"""``python -m benchmarks workloads``: the workloads users run, over each
scheme, in the settings where Dask runs.

The workloads (:mod:`benchmarks._workload_suite`) are small versions of the
tests the Dask maintainers watch for regressions. Each setting is a cluster
of single-threaded workers:

* ``local-2``, ``local-16``: a ``LocalCluster`` of 2 or 16 workers on this host,
  with its scheduler in the process that runs the workloads (the client's);
* ``hosts-10gbit``, ``hosts-1gbit``: 4 simulated hosts (network namespaces,
  egress limited with ``tc tbf``) with 2 workers each, and the scheduler and
  the client on a fifth (the root namespace); needs root.

Rounds alternate the schemes, in an order rotated every round; each round of
a scheme starts a fresh cluster and runs every workload ``--repeat`` times
(once by default), after one untimed run of it at a tiny size (imports, first
connections). The first timed run finds the cluster as it started: memory
its comm has not touched yet is committed on the way (lci's shared memory,
the receive buffers of any scheme). The runs after it (rows ``... warm``)
find what the first run left. What is measured around each timed part is in
:mod:`benchmarks._workload_measure`; the tables report medians over the rounds
and ratios against tcp and ucxx.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks._environment import environment_facts
from benchmarks._procs import PeerError, expect, ignore_sigint, receive, send_quietly, spawned
from benchmarks._workload_suite import BY_NAME, WORKLOADS

#: Size of the untimed run before each workload.
WARM_UP_SIZE = 0.01
#: Seconds a cluster may take to start, plus this per worker.
STARTUP_S, STARTUP_PER_WORKER_S = 60.0, 4.0
#: Seconds one workload (with its warm-up) may take before its round is given up.
WORKLOAD_TIMEOUT_S = 300.0
SCHEMES = ("lci", "tcp", "ucxx")
#: What each scheme needs beyond this package's dependencies.
REQUIRES = {"ucxx": "distributed_ucxx"}


@dataclass(frozen=True)
class Setting:
    name: str
    workers: int
    #: Workers per simulated host; 0 for a ``LocalCluster`` on this host.
    per_host: int = 0
    rate: str | None = None

    @property
    def hosts(self) -> int:
        return self.workers // self.per_host if self.per_host else 1

    def describe(self) -> str:
        if not self.per_host:
            return f"LocalCluster(n_workers={self.workers}, threads_per_worker=1) on one host"
        return (f"{self.hosts} simulated hosts x {self.per_host} workers (1 thread, nanny), "
                f"egress {self.rate} each (tc tbf); scheduler and client on a fifth host")


SETTINGS = (
    Setting("local-2", 2),
    Setting("local-16", 16),
    Setting("hosts-10gbit", 8, per_host=2, rate="10gbit"),
    Setting("hosts-1gbit", 8, per_host=2, rate="1gbit"),
)
_SETTING = {s.name: s for s in SETTINGS}


# ------------------------------------------------------------------- driver


def driver_main(conn: Connection, scheme: str, setting: Setting, address: str | None,
                names: list[str], size: float, repeat: int) -> None:
    """Child process: hold the client (and a ``LocalCluster`` when there is no
    ``address``), run the workloads, report each timed run's measurement."""
    ignore_sigint()
    try:
        _drive(conn, scheme, setting, address, names, size, repeat)
    except Exception:
        send_quietly(conn, ("failed", traceback.format_exc()))


def _drive(conn: Connection, scheme: str, setting: Setting, address: str | None,
           names: list[str], size: float, repeat: int) -> None:
    from distributed import Client, LocalCluster

    # Every p2p shuffle's start and end, logged at warning level by the scheduler.
    logging.getLogger("distributed.shuffle._scheduler_plugin").setLevel(logging.ERROR)

    from benchmarks._cluster import link_providers
    from benchmarks._workload_measure import Meter

    cluster = None
    if address is None:
        cluster = LocalCluster(protocol=scheme, n_workers=setting.workers, threads_per_worker=1,
                               dashboard_address=":0")
    try:
        with Client(cluster or address) as client:
            client.wait_for_workers(setting.workers, timeout=_startup_s(setting))
            meter = Meter(client)
            conn.send(("ready", None))
            for name in names:
                run = BY_NAME[name].run
                try:
                    run(client, WARM_UP_SIZE, meter.timed)
                    for index in range(repeat):
                        meter.last = None
                        run(client, size, meter.timed)
                        if meter.last is None:
                            raise RuntimeError(f"{name} timed nothing")
                        conn.send(("result", name, {**meter.last.to_json(), "run": index}))
                except Exception as exc:
                    conn.send(("error", name, f"{type(exc).__name__}: {exc}".splitlines()[0]))
            conn.send(("links", link_providers(client) if scheme == "lci" else None))
    finally:
        if cluster is not None:
            cluster.close()


def _startup_s(setting: Setting) -> float:
    return STARTUP_S + STARTUP_PER_WORKER_S * setting.workers


# ------------------------------------------------------------------- rounds


@contextmanager
def _scheduler(setting: Setting, scheme: str, logdir: Path) -> Iterator[str | None]:
    """The address of a testbed's scheduler for simulated hosts; None for a
    ``LocalCluster``, which the driver starts itself."""
    if not setting.per_host:
        yield None
        return
    from benchmarks._testbed import testbed

    with testbed(setting.workers, scheme, setting.rate, logdir, per_host=setting.per_host,
                 worker_options=("--memory-limit", "auto")) as bed:
        yield bed.scheduler


def _one_round(setting: Setting, scheme: str, round_index: int, names: list[str], size: float,
               repeat: int, logdir: Path) -> list[dict[str, Any]]:
    """Records of every workload's timed runs on one fresh cluster; errors
    become records. lci's records name the providers each process's links
    ran over."""
    base = {"setting": setting.name, "scheme": scheme, "round": round_index}
    records: list[dict[str, Any]] = []
    try:
        with _scheduler(setting, scheme, logdir) as address, spawned(
            driver_main, scheme, setting, address, names, size, repeat,
            name=f"{scheme}-{setting.name}", daemon=False,
        ) as driver:
            expect(driver, "ready", _startup_s(setting) + 30)
            pending = dict.fromkeys(names, repeat)
            while pending:
                kind, name, payload = receive(driver, WORKLOAD_TIMEOUT_S)
                _progress(_progress_line(setting, scheme, round_index, name, kind, payload))
                records.append({**base, "workload": name,
                                **(payload if kind == "result" else {"error": payload})})
                pending[name] -= 1
                if kind != "result" or not pending[name]:
                    del pending[name]
            links = expect(driver, "links", 60)
    except (PeerError, RuntimeError, OSError) as exc:
        done = {r["workload"] for r in records}
        return records + [{**base, "workload": name, "error": str(exc).splitlines()[0]}
                          for name in names if name not in done]
    return [{**r, "links": links} if links else r for r in records]


def rotated(items: Sequence[str], shift: int) -> list[str]:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def run(settings: Sequence[Setting], schemes: Sequence[str], rounds: int, names: list[str],
        size: float, repeat: int, logdir: Path,
        on_round: Callable[[list[dict[str, Any]]], None] = lambda records: None,
        ) -> list[dict[str, Any]]:
    """Every round's records; ``on_round`` sees them all after each round."""
    records: list[dict[str, Any]] = []
    for setting in settings:
        for round_index in range(rounds):
            for scheme in rotated(schemes, round_index):
                started = time.monotonic()
                records += _one_round(setting, scheme, round_index, names, size, repeat, logdir)
                _progress(f"{setting.name} round {round_index + 1}/{rounds} {scheme}: "
                          f"{time.monotonic() - started:.0f} s")
                on_round(records)
    return records


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _progress_line(setting: Setting, scheme: str, round_index: int, name: str, kind: str,
                   payload: Any) -> str:
    what = f"{payload['seconds']:.2f} s" if kind == "result" else payload
    if kind == "result" and payload["run"]:
        name = row_name(name, payload["run"])
    return f"  {setting.name} r{round_index + 1} {scheme:>5} {name:<19} {what}"


# ------------------------------------------------------------------ reports


def row_name(workload: str, run: int) -> str:
    """A workload's row: its first run on a cluster, or the warm runs after it."""
    return f"{workload} warm" if run else workload


def medians(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """``[setting][row][scheme]``: the median of each measured value over the
    runs that succeeded (an even count: the mean of the middle two); a
    workload's warm runs (see :func:`row_name`) have a row of their own."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        if "error" not in r:
            row = row_name(r["workload"], r.get("run", 0))
            grouped.setdefault((r["setting"], row, r["scheme"]), []).append(r)
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for (setting, workload, scheme), rs in grouped.items():
        out.setdefault(setting, {}).setdefault(workload, {})[scheme] = {
            key: statistics.median(r[key] for r in rs)
            for key in ("seconds", "cpu_seconds", "system_seconds", "minor_faults", "peak_mib",
                        "comm_seconds", "graph_seconds", "share")
            if all(key in r for r in rs)
        } | {"runs": len(rs)}
    return out


def _ratio(m: dict[str, dict[str, float]], key: str, a: str, b: str) -> float | None:
    """``a``'s ``key`` over ``b``'s; None where either lacks it (a run saved
    before the key was measured)."""
    over = m.get(b, {}).get(key, 0.0)
    if over > 0 and key in m.get(a, {}):
        return m[a][key] / over
    return None


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_setting(setting: Setting, per_workload: dict[str, dict[str, dict[str, float]]],
                   schemes: Sequence[str]) -> str:
    """One row per workload: median seconds per scheme, lci's ratios; tcp's
    communication share in its two parts and the ratio lci would reach if
    communication cost nothing (``1 - share``); CPU, minor page faults and peak
    memory against tcp. One geometric mean of the first runs, one of the warm runs."""
    others = [s for s in schemes if s != "lci"]
    head = ["workload", *(f"{s} s" for s in schemes), *(f"lci/{s}" for s in others),
            "tcp comm", "tcp graph", "1-share", "cpu lci/tcp", "faults lci/tcp", "peak lci/tcp"]
    rows = [head]
    ratios: dict[tuple[int, str], list[float]] = {}
    for run, w in [(run, w) for run in (0, 1) for w in WORKLOADS]:
        name = row_name(w.name, run)
        m = per_workload.get(name, {})
        if not m:
            continue
        row = [name, *(_cell(m[s]["seconds"], ".2f") if s in m else "-" for s in schemes)]
        for s in others:
            ratio = _ratio(m, "seconds", "lci", s)
            row.append(_cell(ratio, ".2f"))
            if ratio is not None:
                ratios.setdefault((run, s), []).append(ratio)
        tcp = m.get("tcp")
        row += [_cell(tcp["comm_seconds"] / tcp["seconds"] if tcp else None, ".0%"),
                _cell(tcp["graph_seconds"] / tcp["seconds"] if tcp else None, ".0%"),
                _cell(1 - tcp["share"] if tcp else None, ".2f"),
                _cell(_ratio(m, "cpu_seconds", "lci", "tcp"), ".2f"),
                _cell(_ratio(m, "minor_faults", "lci", "tcp"), ".2f"),
                _cell(_ratio(m, "peak_mib", "lci", "tcp"), ".2f")]
        rows.append(row)
    for run in sorted({run for run, _ in ratios}):
        rows.append([row_name("geometric mean", run), *("" for _ in schemes),
                     *(_cell(geomean(ratios.get((run, s), [])), ".2f") for s in others),
                     *[""] * 6])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                       for i, c in enumerate(r)) for r in rows]
    return "\n".join([f"{setting.name}: {setting.describe()}", *lines])


def report_page(data: dict[str, Any]) -> str:
    """A saved run as Markdown: how it was run, then each setting's table."""
    env = data["environment"]
    argv = " ".join(["python -m benchmarks", *env["argv"][1:]])
    lines = [
        f"- command: `{argv}`, {data['rounds']} rounds, {data.get('repeat', 1)} timed run(s) of "
        f"each workload per cluster, size {data['size']:g}",
        f"- when: {env['timestamp']}; code: `{env['source']}`; took {data['seconds']:,} s",
        f"- machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB; "
        f"Python {env['python']}, distributed {env['distributed']}",
        "",
    ]
    for setting in data["settings"]:
        text = format_setting(Setting(**setting), data["medians"].get(setting["name"], {}),
                              data["schemes"])
        lines += ["```text", text, "```", ""]
    errors = Counter((r["setting"], r["scheme"], r["error"]) for r in data["records"] if "error" in r)
    for (setting_name, scheme, error), count in errors.items():
        lines.append(f"- {count} records failed in {setting_name} over {scheme}: {error}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks workloads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda text: [t.strip() for t in text.split(",") if t.strip()]  # noqa: E731
    parser.add_argument("--quick", action="store_true",
                        help="one round of local-2 at a small size (a check that all runs)")
    parser.add_argument("--settings", type=csv, help=f"default: {','.join(_SETTING)}")
    parser.add_argument("--schemes", type=csv, default=list(SCHEMES),
                        help=f"default: {','.join(SCHEMES)}; one not installed is left out")
    parser.add_argument("--workloads", type=csv, help=f"default: {','.join(BY_NAME)}")
    parser.add_argument("--rounds", type=int, help="default: 3, or 1 with --quick")
    parser.add_argument("--size", type=float, help="data scale, default 1.0 (0.05 with --quick)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs of each workload per cluster, default 1; the runs "
                             "after the first are reported as warm")
    parser.add_argument("--json", type=Path, metavar="OUT",
                        help="write every round's records to OUT, again after each round")
    return parser


def _installed(scheme: str) -> bool:
    module = REQUIRES.get(scheme)
    return module is None or importlib.util.find_spec(module) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names = args.workloads or list(BY_NAME)
    chosen = args.settings or (["local-2"] if args.quick else list(_SETTING))
    unknown = [n for n in names if n not in BY_NAME] + [s for s in chosen if s not in _SETTING]
    if unknown:
        parser.error(f"unknown workloads or settings: {unknown}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    settings = [_SETTING[s] for s in chosen]
    if any(s.per_host for s in settings):
        from dask_lcicomm.testing.netns import unavailable

        if (why := unavailable()) is not None:
            _progress(f"simulated hosts left out: {why}")
            settings = [s for s in settings if not s.per_host]
    schemes = [s for s in args.schemes if _installed(s)]
    left_out = sorted(set(args.schemes) - set(schemes))
    rounds = args.rounds or (1 if args.quick else 3)
    size = args.size or (0.05 if args.quick else 1.0)
    started = time.monotonic()
    environment = environment_facts()  # at the start: its load average is the run's

    def write(records: list[dict[str, Any]], complete: bool = False) -> None:
        """The JSON so far: a run stopped half-way keeps what it measured."""
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "command": "workloads", "environment": environment,
                "settings": [asdict(s) for s in settings], "schemes": schemes, "rounds": rounds,
                "repeat": args.repeat, "size": size, "complete": complete,
                "seconds": round(time.monotonic() - started),
                "records": records, "medians": medians(records),
                "sources": {w.name: w.source for w in WORKLOADS},
            }, indent=1) + "\n")

    try:
        with tempfile.TemporaryDirectory(prefix="workloads-") as logdir:
            records = run(settings, schemes, rounds, names, size, args.repeat, Path(logdir),
                          write)
    except KeyboardInterrupt:
        _progress("interrupted; clusters and simulated hosts were removed")
        return 130
    write(records, complete=True)
    table = medians(records)
    for setting in settings:
        print(format_setting(setting, table.get(setting.name, {}), schemes) + "\n")
    errors = [r for r in records if "error" in r]
    for r in errors:
        print(f"error: {r['setting']} round {r['round'] + 1} {r['scheme']} {r['workload']}: "
              f"{r['error']}")
    if left_out:
        print(f"not installed, left out: {', '.join(left_out)}")
    print(f"{len(records) - len(errors)} measurements in {time.monotonic() - started:.0f} s")
    return 1 if errors else 0
