"""What every side-by-side benchmark shares: rounds that alternate the contenders (drift and
noisy neighbours hit all alike), medians, ratios, the environment, tables and JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import distributed
import numpy
import psutil

from benchmarks._contenders import BASELINE_BUILD, PACKAGE, Configuration, Status, one_line, probe
from benchmarks._procs import PeerError


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str
    higher_is_better: bool


@dataclass(frozen=True)
class Benchmark:
    """What a contender measures: ``spec`` (a frozen dataclass with a ``name``) goes to its
    processes; the first metric is the headline. ``kind`` groups benchmarks in tables and
    figures (default: the name's first word); ``runs`` records come of a contender's round."""

    spec: Any
    metrics: tuple[Metric, ...]
    kind: str = ""
    runs: int = 1

    @property
    def name(self) -> str:
        return str(self.spec.name)

    @property
    def group(self) -> str:
        return self.kind or self.name.split("-")[0]


@dataclass(frozen=True)
class Record:
    """One benchmark, contender and round: its metrics' values and raw numbers, or an error."""

    benchmark: str
    configuration: str
    round: int
    values: dict[str, float] | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


#: One contender's round: every benchmark, each record handed over as soon as it is known.
RoundRunner = Callable[[Configuration, list[Benchmark], int, Callable[[Record], None]], None]


@dataclass
class Run:
    command: str
    configurations: tuple[Configuration, ...]
    benchmarks: tuple[Benchmark, ...]
    rounds: int
    quick: bool
    status: dict[str, Status] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    complete: bool = False

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.configurations)

    def values(self, bench: Benchmark, metric: Metric, label: str) -> list[float | None]:
        return [r.values[metric.key] if r.values else None for r in self.records
                if r.benchmark == bench.name and r.configuration == label]

    def median(self, bench: Benchmark, metric: Metric, label: str) -> float | None:
        """For an even count the worse middle round: reciprocal metrics then give one ratio."""
        good = [v for v in self.values(bench, metric, label) if v is not None]
        pick = statistics.median_low if metric.higher_is_better else statistics.median_high
        return pick(good) if good else None

    def quotient(self, bench: Benchmark, metric: Metric, label: str, base: str) -> float | None:
        ours, theirs = self.median(bench, metric, label), self.median(bench, metric, base)
        return ours / theirs if ours and theirs else None

    def ratio(self, bench: Benchmark, metric: Metric, label: str, base: str) -> float | None:
        """The quotient oriented so that >1 means ``label`` is better."""
        q = self.quotient(bench, metric, label, base)
        return q if q is None or metric.higher_is_better else 1 / q

    def failures(self) -> list[Record]:
        return [r for r in self.records if r.error is not None]


def run(command: str, configurations: Sequence[Configuration], benchmarks: Sequence[Benchmark],
        rounds: int, quick: bool, run_round: RoundRunner, stage: Callable[[Benchmark], Any] = lambda _: 0,
        after_round: Callable[[Run], None] = lambda _: None) -> Run:
    """Every available contender once per round, the order rotated each round; benchmarks of
    one ``stage`` (a cluster's setting) finish their rounds before the next stage's start."""
    labels = [c.label for c in configurations]
    if len(set(labels)) != len(labels):
        raise ValueError(f"configuration labels must be unique, got {labels}")
    result = Run(command, tuple(configurations), tuple(benchmarks), rounds, quick,
                 status=probe(configurations), environment=environment_facts())
    runnable = [c for c in configurations if result.status[c.label].available]
    for label, status in result.status.items():
        if not status.available:
            progress(f"{label}: {status.label} ({status.detail})")
    total, heads = rounds * len(runnable) * sum(b.runs for b in benchmarks), {
        b.name: b.metrics[0] for b in benchmarks}

    def record(r: Record) -> None:
        result.records.append(r)
        head = heads[r.benchmark]
        outcome = f"FAILED: {r.error}" if r.values is None else \
            f"{format_number(r.values[head.key])} {head.unit}"
        progress(f"[{len(result.records)}/{total}] round {r.round + 1} {r.configuration} "
                 f"{r.benchmark}: {outcome}")

    stages: dict[Any, list[Benchmark]] = {}
    for bench in benchmarks:
        stages.setdefault(stage(bench), []).append(bench)
    for benches in stages.values():
        for index, configuration in alternated(runnable, rounds):
            run_round(configuration, benches, index, record)
            after_round(result)
    result.complete = True
    return result


def record_answers(label: str, index: int, specs: Sequence[Any],
                   answers: Iterable[tuple[Any, tuple[str, str, Any]]], record: Callable[[Record], None],
                   measured: Callable[[Any, Any], tuple[dict[str, float], dict[str, Any]]]) -> None:
    """Records the answer ``(kind, name, payload)`` to each spec in turn: a ``"result"``'s metrics
    and raw numbers by ``measured(spec, payload)``, else its error; a :class:`PeerError` (a peer
    died, hung or crashed) or a cluster that did not start fails every spec not answered yet."""
    done = 0
    try:
        for spec, (kind, name, payload) in answers:
            if name != spec.name:
                raise PeerError(f"peer answered {name!r} while {spec.name!r} was expected")
            record(Record(name, label, index, *measured(spec, payload)) if kind == "result"
                   else Record(name, label, index, error=payload))
            done += 1
    except (RuntimeError, OSError) as exc:  # PeerError is a RuntimeError
        for spec in specs[done:]:
            record(Record(spec.name, label, index, error=(str(exc).splitlines() or [""])[0]))


def alternated(contenders: Sequence[Any], rounds: int) -> Iterator[tuple[int, Any]]:
    """``(round, contender)``: every contender once per round, the order rotated each round, so
    that drift and noisy neighbours hit all alike."""
    for index in range(rounds):
        k = index % len(contenders) if contenders else 0
        for contender in [*contenders[k:], *contenders[:k]]:
            yield index, contender


def select(only: Iterable[str] | None, default: Iterable[str], known: Collection[str]) -> list[str]:
    """The names asked for (else ``default``), in ``known``'s order."""
    wanted = set(only or default)
    if unknown := wanted - set(known):
        raise ValueError(f"unknown names {sorted(unknown)}; known: {', '.join(known)}")
    return [name for name in known if name in wanted]


def subset(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names of ``known``, in its order."""

    def names(text: str) -> list[str]:
        try:
            return select(csv(text), (), known)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return names


def progress(line: str) -> None:
    """Progress goes to stderr, so that stdout holds just the tables."""
    print(line, file=sys.stderr, flush=True)


def to_json(result: Run, pairs: Sequence[tuple[str, str]], **config: Any) -> dict[str, Any]:
    """Everything the tables show, every round included, and the command's own ``config``;
    ratios >1: the first label is better."""
    return {
        "command": result.command,
        "environment": result.environment,
        "complete": result.complete, "seconds": round(time.monotonic() - result.started),
        "config": {
            "configurations": [asdict(c) | {"dask_config": c.overrides}
                               for c in result.configurations],
            "rounds": result.rounds, "quick": result.quick,
            "ratios": [f"{a}/{b}" for a, b in pairs],
            "median": "of successful rounds; even count: the worse middle value",
            "benchmarks": [asdict(b.spec) for b in result.benchmarks], **config,
        },
        "status": {label: asdict(s) for label, s in result.status.items()},
        "results": [{
            "benchmark": b.name, "kind": b.group, "metric": m.key, "unit": m.unit,
            "higher_is_better": m.higher_is_better,
            "per_configuration": {label: {"status": result.status[label].label,
                                          "rounds": result.values(b, m, label),
                                          "median": result.median(b, m, label)}
                                  for label in result.labels},
            "ratios": {f"{a}/{c}": result.ratio(b, m, a, c) for a, c in pairs},
        } for b in result.benchmarks for m in b.metrics],
        "raw": [{"benchmark": r.benchmark, "configuration": r.configuration, "round": r.round,
                 **r.raw, "error": r.error} for r in result.records],
        "failed": len(result.failures()),
    }


def table(result: Run, head: Sequence[str], describe: Callable[[Benchmark, Metric], str],
          pairs: Sequence[tuple[str, str]], quotients: bool = False, unit: str = "") -> str:
    """A row per benchmark metric: each contender's median, then per pair the ratio (>1
    better) or, with ``quotients``, the plain quotient of the medians (times: <1 faster)."""
    cells = [[*head, *(f"{label}{unit}" for label in result.labels),
              *(f"{a}/{b}" for a, b in pairs)]]
    rules, previous = [1], None
    for bench in result.benchmarks:
        if previous is not None and bench.group != previous:
            rules.append(len(cells))
        previous = bench.group
        for metric in bench.metrics:
            of = result.quotient if quotients else result.ratio
            cells.append([bench.name, describe(bench, metric),
                          *(median_cell(result, bench, metric, label) for label in result.labels),
                          *(format_ratio(of(bench, metric, a, b)) for a, b in pairs)])
    return "\n".join([*align(cells, 2, rules), "", *notes(result)])


def median_cell(result: Run, bench: Benchmark, metric: Metric, label: str) -> str:
    if not result.status[label].available:
        return result.status[label].label
    median = result.median(bench, metric, label)
    return "error" if median is None else format_number(median)


def notes(result: Run) -> list[str]:
    """Which build each contender ran, where, and everything that went wrong."""
    env = result.environment
    lines = [f"{c.label}: {result.status[c.label].detail}" for c in result.configurations
             if c.pythonpath and result.status[c.label].available]
    lines.append(f"Medians of {result.rounds} round(s); {env['cpu']}, {env['cpu_count']} CPUs, "
                 f"load {env['load_average'][0]:g} at the start; distributed "
                 f"{env['distributed']}; code {env['source']} ({PACKAGE} from {env[PACKAGE]}).")
    lines += [f"{label}: {s.label}: {s.detail}" for label, s in result.status.items()
              if not s.available]
    lines += [f"{r.configuration} {r.benchmark} round {r.round + 1} failed: {r.error}"
              for r in result.failures()]
    return lines


def size_name(nbytes: int) -> str:
    """``8B``, ``16KiB``, ``64MiB``: sizes as benchmark names spell them."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def format_number(value: float) -> str:
    """Few significant digits: the noise is larger than that anyway."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def align(rows: list[list[str]], label_columns: int, rules: Sequence[int] = (1,)) -> list[str]:
    """Labels left, numbers right; a dashed rule before each row index in ``rules``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < label_columns else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    for index in sorted(rules, reverse=True):
        lines.insert(index, "-" * max(map(len, lines)))
    return lines


def environment_facts() -> dict[str, Any]:
    """The machine, versions, code and inherited lci settings (they change every lci contender)."""
    from dask_lcicomm import config

    try:
        settings: dict[str, Any] | str = asdict(config.Settings.from_config())
    except ValueError as exc:
        settings = one_line(exc)
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "platform": platform.platform(),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "distributed": distributed.__version__, "numpy": numpy.__version__,
        "source": source_revision(),
        PACKAGE: os.path.dirname(config.__file__),
        "lci_settings": settings, "argv": sys.argv,
        "inherited_lci_env": {k: v for k, v in os.environ.items()
                              if k.startswith("DASK_DISTRIBUTED__COMM__LCI__")},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def source_revision() -> str:
    """The commit measured, ``-dirty`` if the work tree differs from it."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10, cwd=os.path.dirname(__file__))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def parser(prog: str, description: str, names: Sequence[str], rounds: str,
           baseline: bool = True) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes (``--benchmarks`` if it names any)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {prog}", description=description)
    p.add_argument("--quick", action="store_true", help="tiny budgets, 1 round: a smoke run")
    p.add_argument("--rounds", type=positive, help=f"rounds per configuration (default: {rounds})")
    if names:
        p.add_argument("--benchmarks", type=subset(names), metavar="NAMES",
                       help=f"comma-separated subset of: {','.join(names)}")
    if baseline:
        p.add_argument("--baseline", metavar="PATH", help=f"also measure {BASELINE_BUILD}: lci as "
                       "built by 'pip install --no-deps --target PATH <checkout>'")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every round's numbers to OUT")
    p.add_argument("--plot", type=Path, metavar="DIR", help="draw the figures (PNG) into DIR")
    return p


def tool_parser(prog: str, description: str | None, configs: Collection[str], default: Sequence[str]
                ) -> argparse.ArgumentParser:
    """The options of the tools that measure each configuration apart: ``--configs``, ``--json``."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{prog}", description=description)
    p.add_argument("--configs", type=subset(configs), default=list(default), metavar="NAMES")
    p.add_argument("--json", type=Path, metavar="OUT")
    return p


def csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def positive(text: str) -> int:
    """A count of at least 1 (rounds, runs, peers), or a usage error."""
    if (number := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return number


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def finish(args: argparse.Namespace, text: str, data: dict[str, Any]) -> int:
    """Print the table, write the JSON and figures; 1 if any round failed."""
    print(text, flush=True)
    if args.json:
        write_json(args.json, data)
        progress(f"wrote {args.json}")
    if args.plot:
        draw(data, args.plot)
    return 1 if data["failed"] else 0


def draw(data: dict[str, Any], outdir: Path) -> None:
    from benchmarks.plots import plot

    for path in plot(data, outdir):
        progress(f"wrote {path}")
