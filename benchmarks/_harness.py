"""The measuring harness shared by ``comm``, ``variants`` and ``dask``.

What rounds alternate over is a :class:`Configuration`: a scheme plus Dask
configuration overrides for its peer processes, under a unique label.
``comm`` compares plain schemes (one configuration per scheme); ``variants``
compares the default ``lci`` with copies of it that each switch one knob of
``distributed.comm.lci``.  Both are the same experiment.  ``dask`` reuses
the rounds, medians and reporting with its own round runner (whole graphs on
a ``LocalCluster`` per configuration, see :mod:`benchmarks.dask`).

Why the harness is shaped the way it is:

* All configurations are measured in one run, in alternating rounds, and
  summarised by the per-configuration median, so slow drift and noisy
  neighbours on the machine hit every configuration alike.  The order within
  a round rotates from round to round, so no configuration always runs first
  (e.g. right after the previous round's heaviest benchmark).
* Each round starts a fresh server process and a fresh client process (see
  :mod:`benchmarks._procs`): peers never share an interpreter or a GIL, and a
  backend's process-global state cannot leak from one round into the next --
  which is also what lets a configuration be just per-process Dask config.
* Every loop is bounded in both count and time, and every wait on a child is
  bounded too, so a broken backend yields an "error" cell, not a hang.
* The ``idle`` benchmark is the exception to "comms only": it measures the CPU
  time a whole idle ``LocalCluster`` burns (see :mod:`benchmarks._idle`),
  because a backend that is fast only by spinning costs every other job on
  the node.

This module holds no I/O to the terminal: :func:`run` reports progress through
a callback, and the formatting helpers return strings; the CLI prints.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from time import monotonic
from typing import Any

import distributed
import numpy
from distributed.comm.registry import get_backend

from benchmarks._comm_peers import BenchSpec, Measurement, client_main, server_main
from benchmarks._idle import IDLE_KIND, measure_idle
from benchmarks._procs import Peer, PeerError, expect, receive, spawned

MiB = 2**20

#: Seconds a peer process may take to import everything and start listening.
STARTUP_TIMEOUT_S = 60.0

#: Extra seconds beyond ``duration_s`` before a benchmark counts as hung
#: (covers connecting, warm-up and one final slow iteration; idle: settling).
_SLACK_S = {True: 15.0, False: 60.0}  # keyed by ``quick``

#: Prefix of the environment variables that configure the lci:// backend.
LCI_ENV_PREFIX = "DASK_DISTRIBUTED__COMM__LCI__"


# -------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    """How to turn a raw :class:`Measurement` into a reported number."""

    key: str
    unit: str
    higher_is_better: bool
    compute: Callable[[Measurement, BenchSpec], float]


def _per_second(m: Measurement, spec: BenchSpec) -> float:
    return m.count / m.seconds


def _microseconds_each(m: Measurement, spec: BenchSpec) -> float:
    return m.seconds / m.count * 1e6


def _mib_per_second_both_ways(m: Measurement, spec: BenchSpec) -> float:
    return 2 * spec.payload_bytes * m.count / m.seconds / MiB


#: Idle CPU time is reported per this many seconds of idleness.
IDLE_PER_S = 10.0


def _cpu_seconds_per_idle_period(m: Measurement, spec: BenchSpec) -> float:
    return (m.cpu_seconds or 0.0) / m.seconds * IDLE_PER_S


ROUND_TRIPS = Metric("rate", "round trips/s", True, _per_second)
LATENCY = Metric("latency", "us/round trip", False, _microseconds_each)
MESSAGES = Metric("rate", "messages/s", True, _per_second)
ALL_CHAINS = Metric("rate", "round trips/s, all comms", True, _per_second)
BANDWIDTH = Metric("bandwidth", "MiB/s, 2*size*n/t", True, _mib_per_second_both_ways)
IDLE_CPU = Metric("cpu", f"CPU s per {IDLE_PER_S:g} s idle", False, _cpu_seconds_per_idle_period)


# ---------------------------------------------------------------------- suite


@dataclass(frozen=True)
class Benchmark:
    """What the client measures (``spec``) and how the tables report it;
    the first metric is the benchmark's headline number.

    ``spec`` is a :class:`BenchSpec` here; other suites may use their own
    frozen dataclass with at least ``name`` and ``timeout_s`` (it goes into
    the JSON via :func:`dataclasses.asdict`).
    """

    spec: BenchSpec
    metrics: tuple[Metric, ...]


@dataclass(frozen=True)
class _Plan:
    """A benchmark with its two budgets, as ``(quick, full)`` pairs."""

    name: str
    kind: str
    payload_bytes: int
    metrics: tuple[Metric, ...]
    duration_s: tuple[float, float]
    max_count: tuple[int, int]
    warmup: tuple[int, int]
    chains: int = 1
    settle_s: float = 0.0

    def build(self, quick: bool, duration_scale: float = 1.0) -> Benchmark:
        """The benchmark for one budget; ``duration_scale`` shortens the timed
        window (not the count caps) when a run has many configurations."""
        pick = 0 if quick else 1
        duration = self.duration_s[pick] * duration_scale
        spec = BenchSpec(
            name=self.name,
            kind=self.kind,
            payload_bytes=self.payload_bytes,
            duration_s=duration,
            max_count=self.max_count[pick],
            warmup=self.warmup[pick],
            timeout_s=self.settle_s + duration + _SLACK_S[quick],
            chains=self.chains,
            settle_s=self.settle_s,
        )
        return Benchmark(spec, self.metrics)


_PLANS = (
    _Plan("roundtrip", "pingpong", 8, (ROUND_TRIPS, LATENCY),
          duration_s=(0.1, 1.0), max_count=(300, 200_000), warmup=(5, 100)),
    _Plan("flood", "flood", 8, (MESSAGES,),
          duration_s=(0.1, 1.0), max_count=(2_000, 2_000_000), warmup=(5, 100)),
    _Plan("nchains", "nchains", 8, (ALL_CHAINS,), chains=64,
          duration_s=(0.1, 1.0), max_count=(10, 100_000), warmup=(1, 5)),
    _Plan("pingpong-1MiB", "pingpong", MiB, (BANDWIDTH,),
          duration_s=(0.1, 1.0), max_count=(10, 50_000), warmup=(1, 5)),
    _Plan("pingpong-64MiB", "pingpong", 64 * MiB, (BANDWIDTH,),
          duration_s=(0.2, 2.0), max_count=(2, 1_000), warmup=(1, 1)),
    _Plan("idle", IDLE_KIND, 0, (IDLE_CPU,), settle_s=2.0,
          duration_s=(2.0, 10.0), max_count=(1, 1), warmup=(0, 0)),
)

BENCHMARK_NAMES = tuple(p.name for p in _PLANS)

#: Everything but ``idle``: the benchmarks that only need a server/client pair.
COMM_BENCHMARK_NAMES = tuple(p.name for p in _PLANS if p.kind != IDLE_KIND)


@dataclass(frozen=True)
class Configuration:
    """One contender: ``scheme`` with ``dask_config`` (dotted keys) set in
    each of its peer processes.

    ``label`` identifies it in rounds, tables and JSON, so it must be unique
    within a run.  The overrides are a tuple of pairs to keep the object
    hashable and their order (as shown) stable.
    """

    label: str
    scheme: str
    dask_config: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of_scheme(cls, scheme: str) -> Configuration:
        """A scheme as it comes, labelled with its own name."""
        return cls(scheme, scheme)

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.dask_config)


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; recorded verbatim in the JSON output."""

    configurations: tuple[Configuration, ...]
    rounds: int
    quick: bool
    benchmarks: tuple[Benchmark, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.configurations)


def make_run_config(
    configurations: Sequence[Configuration],
    quick: bool,
    rounds: int,
    only: Iterable[str] | None,
    default_benchmarks: Sequence[str] = BENCHMARK_NAMES,
    duration_scale: float = 1.0,
) -> RunConfig:
    """Validate the selection; ``quick`` shrinks every budget to seconds."""
    wanted = check_selection(configurations, rounds, only, default_benchmarks, BENCHMARK_NAMES)
    return RunConfig(
        configurations=tuple(configurations),
        rounds=rounds,
        quick=quick,
        benchmarks=tuple(p.build(quick, duration_scale) for p in _PLANS if p.name in wanted),
    )


def check_selection(
    configurations: Sequence[Configuration],
    rounds: int,
    only: Iterable[str] | None,
    default: Sequence[str],
    known: Sequence[str],
) -> set[str]:
    """The benchmark names wanted (``only``, else ``default``); raises
    :class:`ValueError` for unknown names, no rounds or duplicate labels --
    user errors the CLI reports as such, before any process starts."""
    wanted = set(only) if only else set(default)
    unknown = wanted - set(known)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; known: {tuple(known)}")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    labels = [c.label for c in configurations]
    if len(set(labels)) != len(labels):
        raise ValueError(f"configuration labels must be unique, got {labels}")
    return wanted


# -------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class SchemeStatus:
    """Whether a scheme can be benchmarked; ``label`` is shown in its cells."""

    available: bool
    label: str
    detail: str = ""


def probe_scheme(scheme: str) -> SchemeStatus:
    """Check that a backend is registered and loads, without any networking.

    Missing optional backends (e.g. ``ucxx`` without ``distributed_ucxx``)
    must degrade to a labelled column rather than abort the whole run.
    """
    try:
        get_backend(scheme)
    except ValueError:
        return SchemeStatus(False, "not installed", f"no backend registered for {scheme}://")
    except Exception as exc:  # registered, but its module is broken/incomplete
        return SchemeStatus(False, "unavailable", f"backend failed to load: {_one_line(exc)}")
    return SchemeStatus(True, "ok")


# -------------------------------------------------------------------- running


@dataclass(frozen=True)
class Outcome:
    """One benchmark, one configuration (by label), one round: a measurement
    or an error."""

    benchmark: str
    configuration: str
    round: int
    measurement: Measurement | None = None
    error: str | None = None


@dataclass
class Report:
    config: RunConfig
    status: dict[str, SchemeStatus]  # by configuration label
    outcomes: list[Outcome] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def values(self, bench: Benchmark, metric: Metric, label: str) -> list[float | None]:
        """Per-round values in round order; ``None`` for failed rounds."""
        return [
            None if o.measurement is None else metric.compute(o.measurement, bench.spec)
            for o in self.outcomes
            if o.benchmark == bench.spec.name and o.configuration == label
        ]

    def median(self, bench: Benchmark, metric: Metric, label: str) -> float | None:
        """Median of the successful rounds; see :func:`conservative_median`."""
        good = [v for v in self.values(bench, metric, label) if v is not None]
        return conservative_median(good, metric.higher_is_better) if good else None

    def ratio(self, bench: Benchmark, metric: Metric, label: str, baseline: str) -> float | None:
        """``label`` relative to ``baseline``, oriented so that >1 means better."""
        ours = self.median(bench, metric, label)
        base = self.median(bench, metric, baseline)
        if not ours or not base:
            return None
        return ours / base if metric.higher_is_better else base / ours

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def conservative_median(values: Sequence[float], higher_is_better: bool) -> float:
    """The median; for an even count, the worse of the two middle values.

    Always picking a real round (rather than averaging two) keeps reciprocal
    metrics consistent: the round trips/s and us/round trip rows then describe
    the same round and give the same ratio, also with ``--quick``'s 2 rounds.
    """
    pick = statistics.median_low if higher_is_better else statistics.median_high
    return pick(values)


#: Runs every benchmark of a run once for one configuration in one round,
#: handing each :class:`Outcome` over as soon as it is known.
RoundRunner = Callable[["RunConfig", "Configuration", int, Callable[["Outcome"], None]], None]


def run(
    config: RunConfig,
    progress: Callable[[str], None] = lambda line: None,
    run_round: RoundRunner | None = None,
) -> Report:
    """Run all rounds, every configuration once per round.

    ``run_round`` is what one configuration does in one round (default: the
    comm benchmarks, then ``idle``); other suites (``dask``) bring their own
    and share the alternation, the medians and the reporting.
    """
    run_round = run_round or _run_round
    report = Report(
        config=config,
        status={c.label: probe_scheme(c.scheme) for c in config.configurations},
        environment=_environment(),
    )
    runnable = [c for c in config.configurations if report.status[c.label].available]
    for label, status in report.status.items():
        if not status.available:
            progress(f"{label}: {status.label} ({status.detail})")

    def record(outcome: Outcome) -> None:
        report.outcomes.append(outcome)
        progress(_progress_line(config, outcome))

    for round_index in range(config.rounds):
        for configuration in rotated(runnable, round_index):
            run_round(config, configuration, round_index, record)
    return report


def rotated(items: Sequence[Configuration], shift: int) -> list[Configuration]:
    """``items`` starting at ``shift`` (mod its length), wrapping around."""
    if not items:
        return []
    k = shift % len(items)
    return [*items[k:], *items[:k]]


def _run_round(
    config: RunConfig,
    configuration: Configuration,
    round_index: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """Run every benchmark once for ``configuration``, reporting each as it
    finishes: first the comm benchmarks (one server/client pair for all), then
    ``idle`` (its own cluster, started only once the comm peers are gone)."""
    specs = [b.spec for b in config.benchmarks]
    comm_specs = [s for s in specs if s.kind != IDLE_KIND]
    if comm_specs:
        _run_comm_specs(comm_specs, configuration, round_index, on_outcome)
    for spec in specs:
        if spec.kind == IDLE_KIND:
            on_outcome(_run_idle(spec, configuration, round_index))


def _run_comm_specs(
    specs: list[BenchSpec],
    configuration: Configuration,
    round_index: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """Run the comm benchmarks in one server/client pair of processes."""
    report_answers(_comm_answers(specs, configuration), specs, configuration.label,
                   round_index, on_outcome)


def _comm_answers(
    specs: list[BenchSpec], configuration: Configuration
) -> Generator[tuple[BenchSpec, Any], None, None]:
    """Each spec with the client's report on it, from a server and a client
    process that both have the configuration's overrides (each side reads its
    own knobs); both are torn down when the generator finishes or is closed."""
    label, overrides = configuration.label, configuration.overrides
    with (
        spawned(server_main, configuration.scheme, name=f"{label}-server",
                dask_config=overrides) as server,
        spawned(client_main, name=f"{label}-client", dask_config=overrides) as client,
    ):
        client.conn.send((_await_server(server), specs))
        deadline = monotonic() + STARTUP_TIMEOUT_S + sum(s.timeout_s for s in specs)
        for spec in specs:
            yield spec, receive(client, deadline - monotonic())
        server.conn.close()  # let the server wind down while the client exits


def report_answers(
    answers: Generator[tuple[Any, Any], None, None],
    specs: Sequence[Any],
    label: str,
    round_index: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """Hand each ``(spec, report)`` of ``answers`` on as an :class:`Outcome`
    as soon as it arrives.

    ``answers`` runs the peers (see :func:`_comm_answers`).  A peer that dies
    or stops answering raises :class:`PeerError` there, which turns every
    spec not answered yet into an error; the generator is closed in every
    case, which tears its processes down.
    """
    finished = 0
    try:
        with closing(answers):
            for spec, message in answers:
                on_outcome(to_outcome(message, spec, label, round_index))
                finished += 1
    except PeerError as exc:
        for spec in specs[finished:]:
            on_outcome(Outcome(spec.name, label, round_index, error=str(exc)))


def _run_idle(spec: BenchSpec, configuration: Configuration, round_index: int) -> Outcome:
    label = configuration.label
    try:
        measurement = measure_idle(
            configuration.scheme, spec, STARTUP_TIMEOUT_S,
            dask_config=configuration.overrides, label=label,
        )
    except PeerError as exc:
        return Outcome(spec.name, label, round_index, error=str(exc))
    return Outcome(spec.name, label, round_index, measurement=measurement)


def _await_server(server: Peer) -> str:
    """Return the server's contact address once it listens."""
    return expect(server, "ready", STARTUP_TIMEOUT_S)


def to_outcome(message: tuple[Any, ...], spec: BenchSpec, label: str, round_index: int) -> Outcome:
    """Decode a peer's ``(kind, name, payload)`` report, ``kind`` being
    "result" or "error"; out-of-order answers mean the peer is confused."""
    kind, name, payload = message
    if name != spec.name:
        raise PeerError(f"peer answered {name!r} while {spec.name!r} was expected")
    if kind == "result":
        return Outcome(name, label, round_index, measurement=payload)
    return Outcome(name, label, round_index, error=payload)


def _progress_line(config: RunConfig, outcome: Outcome) -> str:
    width = max(map(len, config.labels))
    head = (
        f"[round {outcome.round + 1}/{config.rounds}] "
        f"{outcome.configuration:<{width}} {outcome.benchmark:<15}"
    )
    if outcome.measurement is None:
        return f"{head} FAILED: {outcome.error}"
    bench = next(b for b in config.benchmarks if b.spec.name == outcome.benchmark)
    metric = bench.metrics[0]
    m = outcome.measurement
    value = metric.compute(m, bench.spec)
    return f"{head} {format_number(value)} {metric.unit} ({m.summary()})"


# ------------------------------------------------------------------ reporting


def format_number(value: float) -> str:
    """Few significant digits: the noise is larger than that anyway."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def format_ratio(ratio: float | None) -> str:
    """Two decimals; two significant digits below 0.1, which would else all
    read 0.0x or 0.00 (e.g. an in-process gather against a real comm)."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def median_cell(report: Report, bench: Benchmark, metric: Metric, label: str) -> str:
    """An absolute median, or why there is none."""
    status = report.status[label]
    if not status.available:
        return status.label
    median = report.median(bench, metric, label)
    return "error" if median is None else format_number(median)


def unit_label(metric: Metric) -> str:
    return metric.unit if metric.higher_is_better else f"{metric.unit} (lower=better)"


def medians_table(
    report: Report,
    header: tuple[str, str],
    describe: Callable[[Benchmark, Metric], str],
    ratio: Callable[[Benchmark, Metric, str], float | None],
    ratio_labels: Sequence[str],
    baseline: str,
    unit: str = "",
) -> list[str]:
    """The lines of a summary table: one row per benchmark metric with its
    name and ``describe(bench, metric)`` (headed by ``header``), the median
    of every configuration (headed by its label and ``unit``), then a
    ``<label>/<baseline>`` column per ``ratio_labels``, filled by ``ratio``."""
    labels = report.config.labels
    head = [*header, *(f"{label}{unit}" for label in labels),
            *(f"{label}/{baseline}" for label in ratio_labels)]
    rows = [
        [
            bench.spec.name,
            describe(bench, metric),
            *(median_cell(report, bench, metric, label) for label in labels),
            *(format_ratio(ratio(bench, metric, label)) for label in ratio_labels),
        ]
        for bench in report.config.benchmarks
        for metric in bench.metrics
    ]
    return align([head, *rows], label_columns=2)


def align(rows: list[list[str]], label_columns: int, rules: Sequence[int] = (1,)) -> list[str]:
    """Left-align the first ``label_columns`` columns, right-align the
    numbers; a dashed rule goes before each row index in ``rules``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < label_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    rule = "-" * max(map(len, lines))
    for index in sorted(rules, reverse=True):
        lines.insert(index, rule)
    return lines


def common_footnotes(report: Report, explanations: Sequence[str] = ()) -> list[str]:
    """How the numbers were taken, the table's own ``explanations``, and
    everything that went wrong (last, where a reader looks for it)."""
    config = report.config
    notes = [
        f"Values: median over {config.rounds} round(s) per configuration (even count: the "
        f"worse middle value); rounds alternate configurations "
        f"({', '.join(config.labels)}; order rotated each round); server and client each "
        f"in their own process on 127.0.0.1.",
        "Units: higher is better unless marked; MiB/s counts both directions "
        "(2 * payload * round trips / s); pingpong payloads are random bytes.",
        *explanations,
    ]
    return notes + problem_notes(report)


def problem_notes(report: Report) -> list[str]:
    """Configurations that could not run, and every failed round."""
    notes = [
        f"{label}: {status.label}: {status.detail}"
        for label, status in report.status.items()
        if not status.available
    ]
    for failure in report.failures():
        where = f"{failure.configuration} {failure.benchmark} round {failure.round + 1}"
        notes.append(f"{where} failed: {failure.error}")
    return notes


def to_json(report: Report, baseline: str | None) -> dict[str, Any]:
    """Everything needed to recompute the tables: raw per-round numbers too;
    ratios are given against ``baseline`` (a label) if there is one."""
    config = report.config
    return {
        "environment": report.environment,
        "config": {
            "configurations": [
                asdict(c) | {"dask_config": c.overrides} for c in config.configurations
            ],
            "rounds": config.rounds,
            "quick": config.quick,
            "baseline": baseline,
            "median": "of successful rounds; even count: the worse middle value",
            "benchmarks": [asdict(b.spec) for b in config.benchmarks],
        },
        "status": {label: asdict(status) for label, status in report.status.items()},
        "results": [
            _metric_json(report, bench, metric, baseline)
            for bench in config.benchmarks
            for metric in bench.metrics
        ],
        "raw": [_outcome_json(o) for o in report.outcomes],
    }


def _metric_json(
    report: Report, bench: Benchmark, metric: Metric, baseline: str | None
) -> dict[str, Any]:
    ratios = {} if baseline is None else {
        label: report.ratio(bench, metric, label, baseline)
        for label in report.config.labels
        if label != baseline
    }
    return {
        "benchmark": bench.spec.name,
        "metric": metric.key,
        "unit": metric.unit,
        "higher_is_better": metric.higher_is_better,
        "per_configuration": {
            label: {
                "status": report.status[label].label,
                "rounds": report.values(bench, metric, label),
                "median": report.median(bench, metric, label),
            }
            for label in report.config.labels
        },
        "ratio_vs_baseline": ratios,
    }


def _outcome_json(o: Outcome) -> dict[str, Any]:
    m = o.measurement
    return {
        "benchmark": o.benchmark,
        "configuration": o.configuration,
        "round": o.round,
        "count": m.count if m else None,
        "seconds": m.seconds if m else None,
        "cpu_seconds": m.cpu_seconds if m else None,
        "error": o.error,
    }


def _environment() -> dict[str, Any]:
    """The machine and versions, plus any lci knobs the harness inherited:
    those silently change every lci configuration of the run."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "distributed": distributed.__version__,
        "numpy": numpy.__version__,
        "argv": sys.argv,
        "inherited_lci_env": {k: v for k, v in os.environ.items() if k.startswith(LCI_ENV_PREFIX)},
    }


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
