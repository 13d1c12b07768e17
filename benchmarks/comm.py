"""Side-by-side benchmarks of Dask comm backends (``lci``, ``tcp``, ``ucxx``).

Why the harness is shaped the way it is:

* All schemes are measured in one run, in alternating rounds (lci, tcp, lci,
  tcp, ...) and summarised by the per-scheme median, so slow drift and noisy
  neighbours on the machine hit every scheme alike.
* Each round starts a fresh server process and a fresh client process (see
  :mod:`benchmarks._procs`): peers never share an interpreter or a GIL, and a
  backend's process-global state cannot leak from one round into the next.
* Every loop is bounded in both count and time, and every wait on a child is
  bounded too, so a broken backend yields an "error" cell, not a hang.
* The ``idle`` benchmark is the exception to "comms only": it measures the CPU
  time a whole idle ``LocalCluster`` burns on each scheme (see
  :mod:`benchmarks._idle`), because a backend that is fast only by spinning
  costs every other job on the node.

This module holds no I/O to the terminal: :func:`run` reports progress through
a callback and :func:`format_table` returns a string; the CLI prints.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from time import monotonic
from typing import Any

import distributed
import numpy
from distributed.comm.registry import get_backend

from benchmarks._comm_peers import BenchSpec, Measurement, client_main, server_main
from benchmarks._idle import IDLE_KIND, N_WORKERS, measure_idle
from benchmarks._procs import Peer, PeerError, expect, receive, spawned

MiB = 2**20

#: The scheme that ratio columns divide by.
BASELINE = "tcp"

#: Seconds a peer process may take to import everything and start listening.
STARTUP_TIMEOUT_S = 60.0

#: Extra seconds beyond ``duration_s`` before a benchmark counts as hung
#: (covers connecting, warm-up and one final slow iteration; idle: settling).
_SLACK_S = {True: 15.0, False: 60.0}  # keyed by ``quick``


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
    """What the client measures (``spec``) and how the table reports it."""

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

    def build(self, quick: bool) -> Benchmark:
        pick = 0 if quick else 1
        duration = self.duration_s[pick]
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


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; recorded verbatim in the JSON output."""

    schemes: tuple[str, ...]
    rounds: int
    quick: bool
    benchmarks: tuple[Benchmark, ...]


def make_config(
    schemes: Sequence[str],
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
) -> RunConfig:
    """Select benchmarks and budgets; ``quick`` shrinks everything to seconds."""
    wanted = set(only) if only else set(BENCHMARK_NAMES)
    unknown = wanted - set(BENCHMARK_NAMES)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; known: {BENCHMARK_NAMES}")
    if rounds is not None and rounds < 1:
        raise ValueError("rounds must be >= 1")
    return RunConfig(
        schemes=tuple(dict.fromkeys(schemes)),  # de-duplicated, order kept
        rounds=rounds or (2 if quick else 5),
        quick=quick,
        benchmarks=tuple(p.build(quick) for p in _PLANS if p.name in wanted),
    )


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
    """One benchmark, one scheme, one round: a measurement or an error."""

    benchmark: str
    scheme: str
    round: int
    measurement: Measurement | None = None
    error: str | None = None


@dataclass
class Report:
    config: RunConfig
    status: dict[str, SchemeStatus]
    outcomes: list[Outcome] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def values(self, bench: Benchmark, metric: Metric, scheme: str) -> list[float | None]:
        """Per-round values in round order; ``None`` for failed rounds."""
        return [
            None if o.measurement is None else metric.compute(o.measurement, bench.spec)
            for o in self.outcomes
            if o.benchmark == bench.spec.name and o.scheme == scheme
        ]

    def median(self, bench: Benchmark, metric: Metric, scheme: str) -> float | None:
        """Median of the successful rounds; see :func:`conservative_median`."""
        good = [v for v in self.values(bench, metric, scheme) if v is not None]
        return conservative_median(good, metric.higher_is_better) if good else None

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


def run(config: RunConfig, progress: Callable[[str], None] = lambda line: None) -> Report:
    """Run all rounds, alternating schemes within each round."""
    report = Report(
        config=config,
        status={scheme: probe_scheme(scheme) for scheme in config.schemes},
        environment=_environment(),
    )
    runnable = [s for s in config.schemes if report.status[s].available]
    for scheme in config.schemes:
        if scheme not in runnable:
            progress(f"{scheme}: {report.status[scheme].label} ({report.status[scheme].detail})")

    def record(outcome: Outcome) -> None:
        report.outcomes.append(outcome)
        progress(_progress_line(config, outcome))

    for round_index in range(config.rounds):
        for scheme in runnable:
            _run_round(config, scheme, round_index, on_outcome=record)
    return report


def _run_round(
    config: RunConfig, scheme: str, round_index: int, on_outcome: Callable[[Outcome], None]
) -> None:
    """Run every benchmark once for ``scheme``, reporting each as it finishes:
    first the comm benchmarks (one server/client pair for all), then ``idle``
    (its own cluster, started only once the comm peers are gone)."""
    specs = [b.spec for b in config.benchmarks]
    comm_specs = [s for s in specs if s.kind != IDLE_KIND]
    if comm_specs:
        _run_comm_specs(comm_specs, scheme, round_index, on_outcome)
    for spec in specs:
        if spec.kind == IDLE_KIND:
            on_outcome(_run_idle(spec, scheme, round_index))


def _run_comm_specs(
    specs: list[BenchSpec], scheme: str, round_index: int, on_outcome: Callable[[Outcome], None]
) -> None:
    """Run the comm benchmarks in one server/client pair of processes.

    A peer that dies or stops answering turns all of its remaining benchmarks
    into errors; the processes are torn down in every case.
    """
    finished = 0
    try:
        with (
            spawned(server_main, scheme, name=f"{scheme}-server") as server,
            spawned(client_main, name=f"{scheme}-client") as client,
        ):
            client.conn.send((_await_server(server), specs))
            deadline = monotonic() + STARTUP_TIMEOUT_S + sum(s.timeout_s for s in specs)
            for spec in specs:
                message = receive(client, deadline - monotonic())
                on_outcome(_to_outcome(message, spec, scheme, round_index))
                finished += 1
            server.conn.close()  # let the server wind down while the client exits
    except PeerError as exc:
        for spec in specs[finished:]:
            on_outcome(Outcome(spec.name, scheme, round_index, error=str(exc)))


def _run_idle(spec: BenchSpec, scheme: str, round_index: int) -> Outcome:
    try:
        measurement = measure_idle(scheme, spec, STARTUP_TIMEOUT_S)
    except PeerError as exc:
        return Outcome(spec.name, scheme, round_index, error=str(exc))
    return Outcome(spec.name, scheme, round_index, measurement=measurement)


def _await_server(server: Peer) -> str:
    """Return the server's contact address once it listens."""
    return expect(server, "ready", STARTUP_TIMEOUT_S)


def _to_outcome(
    message: tuple[Any, ...], spec: BenchSpec, scheme: str, round_index: int
) -> Outcome:
    """Decode a client report; out-of-order answers mean the client is confused."""
    kind, name, payload = message
    if name != spec.name:
        raise PeerError(f"client answered {name!r} while {spec.name!r} was expected")
    if kind == "result":
        return Outcome(name, scheme, round_index, measurement=payload)
    return Outcome(name, scheme, round_index, error=payload)


def _progress_line(config: RunConfig, outcome: Outcome) -> str:
    width = max(map(len, config.schemes))
    head = (
        f"[round {outcome.round + 1}/{config.rounds}] "
        f"{outcome.scheme:<{width}} {outcome.benchmark:<15}"
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


def ratio_schemes(config: RunConfig) -> list[str]:
    """Schemes that get a ``<scheme>/tcp`` column (needs tcp in the run)."""
    if BASELINE not in config.schemes:
        return []
    return [s for s in config.schemes if s != BASELINE]


def _ratio(report: Report, bench: Benchmark, metric: Metric, scheme: str) -> float | None:
    """``scheme`` relative to the baseline, oriented so that >1 means better."""
    ours = report.median(bench, metric, scheme)
    base = report.median(bench, metric, BASELINE)
    if not ours or not base:
        return None
    return ours / base if metric.higher_is_better else base / ours


def _cell(report: Report, bench: Benchmark, metric: Metric, scheme: str) -> str:
    status = report.status[scheme]
    if not status.available:
        return status.label
    median = report.median(bench, metric, scheme)
    return "error" if median is None else format_number(median)


def format_table(report: Report) -> str:
    """The summary table (medians) plus footnotes explaining how to read it."""
    config = report.config
    ratios = ratio_schemes(config)
    header = ["benchmark", "metric [unit]", *config.schemes, *(f"{s}/{BASELINE}" for s in ratios)]
    rows = []
    for bench in config.benchmarks:
        for metric in bench.metrics:
            rows.append([
                bench.spec.name,
                metric.unit if metric.higher_is_better else f"{metric.unit} (lower=better)",
                *(_cell(report, bench, metric, s) for s in config.schemes),
                *(_format_ratio(_ratio(report, bench, metric, s)) for s in ratios),
            ])
    return "\n".join([*_align([header, *rows]), "", *_footnotes(report)])


def _format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _align(rows: list[list[str]]) -> list[str]:
    """Left-align the two label columns, right-align the numbers."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def _footnotes(report: Report) -> list[str]:
    config = report.config
    notes = [
        f"Values: median over {config.rounds} round(s) per scheme (even count: the worse "
        f"middle value); rounds alternate "
        f"schemes ({', '.join(config.schemes)}, ...); server and client each in "
        f"their own process on 127.0.0.1.",
        "Units: higher is better unless marked; MiB/s counts both directions "
        "(2 * payload * round trips / s); pingpong payloads are random bytes.",
    ]
    if ratio_schemes(config):
        notes.append(
            f"Ratios: <scheme>/{BASELINE} of the medians, >1 means <scheme> is better "
            f"(for lower-is-better metrics the ratio is {BASELINE}/<scheme>)."
        )
    notes.extend(_idle_footnote(bench.spec) for bench in config.benchmarks
                 if bench.spec.kind == IDLE_KIND)
    for scheme, status in report.status.items():
        if not status.available:
            notes.append(f"{scheme}: {status.label}: {status.detail}")
    for failure in report.failures():
        where = f"{failure.scheme} {failure.benchmark} round {failure.round + 1}"
        notes.append(f"{where} failed: {failure.error}")
    return notes


def _idle_footnote(spec: BenchSpec) -> str:
    return (
        f"{spec.name}: CPU seconds (user+sys) of a whole idle LocalCluster(protocol=<scheme>, "
        f"n_workers={N_WORKERS}, processes=True) plus Client, i.e. of its process tree "
        f"(scheduler, client and nannies in one process, one process per worker), over "
        f"{spec.duration_s:g} s after {spec.settle_s:g} s of settling, scaled to "
        f"{IDLE_PER_S:g} s; lower is better, so the ratio is {BASELINE}/<scheme>: "
        f">1 means <scheme> burns less CPU while idle."
    )


def to_json(report: Report) -> dict[str, Any]:
    """Everything needed to recompute the table: raw per-round numbers too."""
    config = report.config
    return {
        "environment": report.environment,
        "config": {
            "schemes": list(config.schemes),
            "rounds": config.rounds,
            "quick": config.quick,
            "baseline": BASELINE,
            "median": "of successful rounds; even count: the worse middle value",
            "benchmarks": [asdict(b.spec) for b in config.benchmarks],
        },
        "schemes": {s: asdict(status) for s, status in report.status.items()},
        "results": [
            _metric_json(report, bench, metric)
            for bench in config.benchmarks
            for metric in bench.metrics
        ],
        "raw": [
            {
                "benchmark": o.benchmark,
                "scheme": o.scheme,
                "round": o.round,
                "count": o.measurement.count if o.measurement else None,
                "seconds": o.measurement.seconds if o.measurement else None,
                "cpu_seconds": o.measurement.cpu_seconds if o.measurement else None,
                "error": o.error,
            }
            for o in report.outcomes
        ],
    }


def _metric_json(report: Report, bench: Benchmark, metric: Metric) -> dict[str, Any]:
    schemes = report.config.schemes
    return {
        "benchmark": bench.spec.name,
        "metric": metric.key,
        "unit": metric.unit,
        "higher_is_better": metric.higher_is_better,
        "per_scheme": {
            s: {
                "status": report.status[s].label,
                "rounds": report.values(bench, metric, s),
                "median": report.median(bench, metric, s),
            }
            for s in schemes
        },
        "ratio_vs_baseline": {
            s: _ratio(report, bench, metric, s) for s in ratio_schemes(report.config)
        },
    }


def _environment() -> dict[str, Any]:
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "distributed": distributed.__version__,
        "numpy": numpy.__version__,
        "argv": sys.argv,
    }


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
