"""The runner every harness-based command shares (``comm``, ``variants``,
``dask``): rounds that alternate over the configurations of a run, the
outcomes they collect into a :class:`Report`, its medians and ratios, and
its JSON.  What one configuration does in one round is the suite's
(:data:`RoundRunner`).

Why it is shaped the way it is:

* All configurations are measured in one run, in alternating rounds, and
  summarised by the per-configuration median, so slow drift and noisy
  neighbours on the machine hit every configuration alike.  The order within
  a round rotates from round to round, so no configuration always runs first
  (e.g. right after the previous round's heaviest benchmark).
* Every loop is bounded in both count and time, and every wait on a child is
  bounded too, so a broken backend yields an "error" cell, not a hang.

This module holds no I/O to the terminal: :func:`run` reports progress through
a callback; the CLI prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from benchmarks._comm_peers import Measurement
from benchmarks._configurations import Configuration, SchemeStatus, probe_configurations
from benchmarks._environment import environment_facts
from benchmarks._format import format_number
from benchmarks._procs import PeerError
from benchmarks._progress import SILENT, Progress

#: What a suite sends its measuring process for one benchmark: a
#: :class:`BenchSpec` here, a frozen dataclass of the suite's own elsewhere.
SpecT = TypeVar("SpecT")


@dataclass(frozen=True)
class Metric(Generic[SpecT]):
    """How to turn a raw :class:`Measurement` into a reported number."""

    key: str
    unit: str
    higher_is_better: bool
    compute: Callable[[Measurement, SpecT], float]


@dataclass(frozen=True)
class Benchmark(Generic[SpecT]):
    """What the client measures (``spec``) and how the tables report it;
    the first metric is the benchmark's headline number.

    ``spec`` is a :class:`BenchSpec` here; other suites may use their own
    frozen dataclass with at least ``name`` and ``timeout_s`` (it goes into
    the JSON via :func:`dataclasses.asdict`).
    """

    spec: SpecT
    metrics: tuple[Metric[SpecT], ...]


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; recorded verbatim in the JSON output."""

    configurations: tuple[Configuration, ...]
    rounds: int
    quick: bool
    benchmarks: tuple[Benchmark[Any], ...]  # of one suite, so of one spec type

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.configurations)


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
        quotient = self.quotient(bench, metric, label, baseline)
        if quotient is None:
            return None
        return quotient if metric.higher_is_better else 1 / quotient

    def quotient(self, bench: Benchmark, metric: Metric, label: str, baseline: str
                 ) -> float | None:
        """The median of ``label`` over that of ``baseline``, as measured."""
        ours = self.median(bench, metric, label)
        base = self.median(bench, metric, baseline)
        return ours / base if ours and base else None

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
    run_round: RoundRunner,
    progress: Progress = SILENT,
    title: str = "benchmarks",
) -> Report:
    """Run all rounds, every available configuration once per round.

    ``run_round`` is what one configuration does in one round (the comm
    suite's, :func:`benchmarks._comm_suite.run_comm_round`; ``dask`` brings
    its own): the suites share the alternation, the medians and the
    reporting.  ``progress`` gets one step per benchmark, configuration and
    round.
    """
    report = Report(
        config=config,
        status=probe_configurations(config.configurations),
        environment=environment_facts(),
    )
    runnable = [c for c in config.configurations if report.status[c.label].available]
    progress.start(title, config.rounds * len(runnable) * len(config.benchmarks))
    for label, status in report.status.items():
        if not status.available:
            progress.note(f"{label}: {status.label} ({status.detail})")

    def record(outcome: Outcome) -> None:
        report.outcomes.append(outcome)
        progress.step(_progress_line(config, outcome))

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


def to_outcome(message: tuple[Any, ...], spec: Any, label: str, round_index: int) -> Outcome:
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


def to_json(report: Report, ratio_pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Everything needed to recompute the tables: raw per-round numbers too;
    ratios (oriented: >1 means the first label is better) for each
    ``(label, baseline)`` of ``ratio_pairs``, keyed ``"label/baseline"``."""
    config = report.config
    return {
        "environment": report.environment,
        "config": {
            "configurations": [
                asdict(c) | {"dask_config": c.overrides} for c in config.configurations
            ],
            "rounds": config.rounds,
            "quick": config.quick,
            "ratios": [f"{label}/{baseline}" for label, baseline in ratio_pairs],
            "median": "of successful rounds; even count: the worse middle value",
            "benchmarks": [asdict(b.spec) for b in config.benchmarks],
        },
        "status": {label: asdict(status) for label, status in report.status.items()},
        "results": [
            _metric_json(report, bench, metric, ratio_pairs)
            for bench in config.benchmarks
            for metric in bench.metrics
        ],
        "raw": [_outcome_json(o) for o in report.outcomes],
    }


def _metric_json(
    report: Report, bench: Benchmark, metric: Metric, ratio_pairs: Sequence[tuple[str, str]]
) -> dict[str, Any]:
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
        "ratios": {
            f"{label}/{baseline}": report.ratio(bench, metric, label, baseline)
            for label, baseline in ratio_pairs
        },
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
