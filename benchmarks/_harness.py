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
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import ExitStack, closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any, Generic, TypeVar

import distributed
import numpy
import psutil
from distributed.comm.registry import get_backend

from benchmarks._comm_peers import BenchSpec, Measurement, Server, client_main, server_main
from benchmarks._floor_comm import SCHEME as FLOOR
from benchmarks._idle import IDLE_KIND, N_WORKERS, measure_idle
from benchmarks._procs import Peer, PeerError, expect, receive, report_origin, spawned
from benchmarks._progress import SILENT, Progress

MiB = 2**20

#: Seconds a peer process may take to import everything and start listening.
STARTUP_TIMEOUT_S = 60.0

#: Extra seconds beyond ``duration_s`` before a benchmark counts as hung
#: (covers connecting, warm-up and one final slow iteration; idle: settling).
_SLACK_S = {True: 15.0, False: 60.0}  # keyed by ``quick``

#: Prefix of the environment variables that configure the lci:// backend.
LCI_ENV_PREFIX = "DASK_DISTRIBUTED__COMM__LCI__"

#: What a suite sends its measuring process for one benchmark: a
#: :class:`BenchSpec` here, a frozen dataclass of the suite's own elsewhere.
SpecT = TypeVar("SpecT")


# -------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric(Generic[SpecT]):
    """How to turn a raw :class:`Measurement` into a reported number."""

    key: str
    unit: str
    higher_is_better: bool
    compute: Callable[[Measurement, SpecT], float]


def _per_second(m: Measurement, spec: BenchSpec) -> float:
    return m.count / m.seconds


def _microseconds_each(m: Measurement, spec: BenchSpec) -> float:
    return m.seconds / m.count * 1e6


def _microseconds_per_chain(m: Measurement, spec: BenchSpec) -> float:
    """The round-trip time one of ``spec.comms`` concurrent chains saw."""
    return spec.comms * m.seconds / m.count * 1e6


def _mib_per_second_both_ways(m: Measurement, spec: BenchSpec) -> float:
    return 2 * spec.payload_bytes * m.count / m.seconds / MiB


#: Idle CPU time is reported per this many seconds of idleness.
IDLE_PER_S = 10.0


def _cpu_seconds_per_idle_period(m: Measurement, spec: BenchSpec) -> float:
    return (m.cpu_seconds or 0.0) / m.seconds * IDLE_PER_S


LATENCY = Metric("latency", "us/round trip", False, _microseconds_each)
MESSAGES = Metric("rate", "messages/s", True, _per_second)
ALL_CHAINS = Metric("rate", "round trips/s, all comms", True, _per_second)
CHAIN_LATENCY = Metric("latency", "us/round trip, each comm", False, _microseconds_per_chain)
BANDWIDTH = Metric("bandwidth", "MiB/s, 2*size*n/t", True, _mib_per_second_both_ways)
IDLE_CPU = Metric("cpu", f"CPU s per {IDLE_PER_S:g} s idle", False, _cpu_seconds_per_idle_period)


# ---------------------------------------------------------------------- suite


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
class _Plan:
    """A benchmark with its two budgets, as ``(quick, full)`` pairs."""

    name: str
    kind: str
    payload_bytes: int
    metrics: tuple[Metric[BenchSpec], ...]
    duration_s: tuple[float, float]
    max_count: tuple[int, int]
    warmup: tuple[int, int]
    comms: int = 1
    settle_s: tuple[float, float] = (0.0, 0.0)

    def build(self, quick: bool, duration_scale: float = 1.0) -> Benchmark[BenchSpec]:
        """The benchmark for one budget; ``duration_scale`` shortens the timed
        window (not the count caps) when a run has many configurations."""
        pick = 0 if quick else 1
        duration = self.duration_s[pick] * duration_scale
        settle = self.settle_s[pick]
        spec = BenchSpec(
            name=self.name,
            kind=self.kind,
            payload_bytes=self.payload_bytes,
            duration_s=duration,
            max_count=self.max_count[pick],
            warmup=self.warmup[pick],
            timeout_s=settle + duration + _SLACK_S[quick],
            comms=self.comms,
            settle_s=settle,
        )
        return Benchmark(spec, self.metrics)


KiB = 2**10

#: The ping-pong sweep, 8 B .. 64 MiB: latency where small, bandwidth where large.
PINGPONG_SIZES = (8, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
#: Flood payloads (a tiny task message; a small array chunk) and concurrent senders.
FLOOD_SIZES = (8, 16 * KiB)
FLOOD_SENDERS = (1, 4, 16)
#: Concurrent ping-pong chains for latency under load.
CHAINS = (1, 4, 16, 64, 256, 1024)


def size_name(nbytes: int) -> str:
    """``8B``, ``16KiB``, ``64MiB``: sizes as they appear in benchmark names."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _pingpong(size: int) -> _Plan:
    """Round trips of one message; big ones get a longer window (each takes
    tens of ms) and fewer untimed warm-up trips."""
    big = size >= 16 * MiB
    return _Plan(f"pingpong-{size_name(size)}", "pingpong", size, (LATENCY, BANDWIDTH),
                 duration_s=(0.2, 1.5) if big else (0.05, 0.3),
                 max_count=(200, 200_000),
                 warmup=(1, 1) if big else (2, 100 if size <= 64 * KiB else 5))


def _flood(size: int, senders: int) -> _Plan:
    return _Plan(f"flood-{size_name(size)}-x{senders}", "flood", size, (MESSAGES,),
                 comms=senders, duration_s=(0.05, 0.5), max_count=(500, 2_000_000),
                 warmup=(2, 20))


def _nchains(chains: int) -> _Plan:
    return _Plan(f"nchains-{chains}", "nchains", 8, (ALL_CHAINS, CHAIN_LATENCY), comms=chains,
                 duration_s=(0.05, 0.5), max_count=(5, 100_000), warmup=(1, 2))


_PLANS = (
    *(_pingpong(size) for size in PINGPONG_SIZES),
    *(_flood(size, senders) for size in FLOOD_SIZES for senders in FLOOD_SENDERS),
    *(_nchains(chains) for chains in CHAINS),
    _Plan("idle", IDLE_KIND, 0, (IDLE_CPU,), settle_s=(0.5, 2.0),
          duration_s=(1.0, 10.0), max_count=(1, 1), warmup=(0, 0)),
)

BENCHMARK_NAMES = tuple(p.name for p in _PLANS)


def family(name: str) -> str:
    """``pingpong``, ``flood``, ``nchains``...: what tables group rows by."""
    return name.split("-")[0]


@dataclass(frozen=True)
class Configuration:
    """One contender: ``scheme`` with ``dask_config`` (dotted keys) set in
    each of its peer processes, which look for modules in ``pythonpath``
    first if one is given (another build of the backend, see
    :func:`baseline_build`).

    ``label`` identifies it in rounds, tables and JSON, so it must be unique
    within a run.  The overrides are a tuple of pairs to keep the object
    hashable and their order (as shown) stable.

    ``provider`` pins an lci configuration to one fabric: every comm its
    peers open, and every link of its idle cluster, must run over it, or the
    benchmark fails -- lci falls back to tcp when a provider cannot be used,
    and a silent fallback would put tcp's numbers under this label.
    ``requires`` is a module (an extra's) without which the configuration
    shows as "not installed" instead of running.
    """

    label: str
    scheme: str
    dask_config: tuple[tuple[str, Any], ...] = ()
    pythonpath: str | None = None
    provider: str | None = None
    requires: str | None = None

    @classmethod
    def of_scheme(cls, scheme: str) -> Configuration:
        """A scheme as it comes, labelled with its own name."""
        return cls(scheme, scheme)

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.dask_config)


#: The package a baseline build replaces in its processes.
PACKAGE = "dask_lcicomm"

#: The label of lci as built elsewhere (``--baseline``).
BASELINE_BUILD = "lci@baseline"


def baseline_build(path: str | os.PathLike[str]) -> Configuration:
    """``lci`` without overrides, all of whose processes import
    :data:`PACKAGE` from ``path``: a directory holding another build of it,
    as ``pip install --no-deps --target PATH <checkout>`` makes one.  Raises
    :class:`ValueError` if ``path`` holds no such package (a user error)."""
    directory = Path(path).resolve()
    if not (directory / PACKAGE / "__init__.py").is_file():
        raise ValueError(f"baseline {path}: no {PACKAGE} package in it (make one with "
                         f"pip install --no-deps --target {path} <checkout>)")
    return Configuration(BASELINE_BUILD, "lci", pythonpath=str(directory))


def with_baseline_build(
    configurations: Sequence[Configuration], path: str | os.PathLike[str] | None
) -> list[Configuration]:
    """``configurations`` plus :func:`baseline_build` of ``path`` right after
    the plain lci one (last if there is none); unchanged without ``path``."""
    result = list(configurations)
    if path is None:
        return result
    labels = [c.label for c in result]
    result.insert(labels.index("lci") + 1 if "lci" in labels else len(result),
                  baseline_build(path))
    return result


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


def _installed(configuration: Configuration) -> SchemeStatus:
    """Its scheme loads (:func:`probe_scheme`) and the module it
    ``requires`` is there -- looked up, not imported: a fabric's bindings
    may start a runtime on import, which the harness has no use for."""
    status = probe_scheme(configuration.scheme)
    module = configuration.requires
    if status.available and module:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # its parent package missing, or broken
            found = False
        if not found:
            return SchemeStatus(False, "not installed", f"no module {module} (its extra is missing)")
    return status


def probe_configurations(configurations: Sequence[Configuration]) -> dict[str, SchemeStatus]:
    """The status of each configuration, by label.

    What a configuration needs must be installed (:func:`_installed`); a
    configuration with Dask overrides must also be accepted where it
    matters, at start-up in a process of its own: a server peer with the
    overrides has to come up listening.
    A setting the backend rejects (a provider it does not ship) thus marks
    its configuration "unavailable" before the run instead of failing every
    round.  A configuration with a ``pythonpath`` (another build) must also
    come up, and a child of it must report :data:`PACKAGE` imported from
    there (:func:`_build_status`).  The children start all at once, so
    probing costs one start-up.
    """
    status = {c.label: _installed(c) for c in configurations}
    to_start = [c for c in configurations
                if (c.dask_config or c.pythonpath) and status[c.label].available]
    with ExitStack() as stack:
        servers = {
            c.label: stack.enter_context(spawned(server_main, c.scheme, name=f"{c.label}-probe",
                                                 dask_config=c.overrides,
                                                 pythonpath=c.pythonpath))
            for c in to_start
        }
        builds = {
            c.label: (c.pythonpath, stack.enter_context(
                spawned(report_origin, PACKAGE, name=f"{c.label}-origin", pythonpath=c.pythonpath)))
            for c in to_start if c.pythonpath
        }
        for label, server in servers.items():
            try:
                _await_server(server)
            except PeerError as exc:
                status[label] = SchemeStatus(False, "unavailable", f"rejected at start-up: {exc}")
        for label, (path, child) in builds.items():
            if status[label].available:
                status[label] = _build_status(path, child)
    return status


def _build_status(path: str, child: Peer) -> SchemeStatus:
    """Available if ``child`` (started with ``path`` first on its module
    path) imported :data:`PACKAGE` from ``path``; the detail says from where,
    and what the build was made of."""
    try:
        origin = Path(expect(child, "origin", STARTUP_TIMEOUT_S)).resolve().parent
    except PeerError as exc:
        return SchemeStatus(False, "unavailable", f"no {PACKAGE} from {path}: {exc}")
    if not origin.is_relative_to(Path(path).resolve()):
        return SchemeStatus(False, "unavailable", f"{PACKAGE} imported from {origin}, not {path}")
    source = _build_source(path)
    return SchemeStatus(True, "ok", f"{PACKAGE} from {origin}" + (f" ({source})" if source else ""))


def _build_source(path: str) -> str | None:
    """The checkout ``pip install --target path`` built from, as its record
    says, at its current revision (if it is a git work tree still)."""
    for record in sorted(Path(path).glob(f"{PACKAGE.replace('_', '?')}-*.dist-info/direct_url.json")):
        try:
            url = json.loads(record.read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not url.startswith("file://"):
            return f"built from {url}"
        checkout = urllib.parse.unquote(url.removeprefix("file://"))
        revision = _source_revision(checkout) if os.path.isdir(checkout) else "unknown"
        return f"built from {checkout}, now at {revision}"
    return None


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
    progress: Progress = SILENT,
    run_round: RoundRunner | None = None,
    title: str = "benchmarks",
) -> Report:
    """Run all rounds, every available configuration once per round.

    ``run_round`` is what one configuration does in one round (default: the
    comm benchmarks, then ``idle``); other suites (``dask``) bring their own
    and share the alternation, the medians and the reporting.  ``progress``
    gets one step per benchmark, configuration and round.
    """
    run_round = run_round or _run_round
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
    own knobs), the client checking its comms' provider if the configuration
    pins one; both are torn down when the generator finishes or is closed."""
    label, overrides, path = configuration.label, configuration.overrides, configuration.pythonpath
    with (
        spawned(server_main, configuration.scheme, name=f"{label}-server",
                dask_config=overrides, pythonpath=path) as server,
        spawned(client_main, name=f"{label}-client", dask_config=overrides,
                pythonpath=path) as client,
    ):
        client.conn.send((Server(_await_server(server), configuration.provider), specs))
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
    if configuration.scheme == FLOOR:
        return Outcome(spec.name, label, round_index,
                       error="floor:// is a reference for the comm API alone: no cluster runs on it")
    try:
        measurement = measure_idle(
            configuration.scheme, spec, STARTUP_TIMEOUT_S,
            dask_config=configuration.overrides, label=label,
            pythonpath=configuration.pythonpath, provider=configuration.provider,
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
    ratio: Callable[[Benchmark, Metric, str, str], float | None],
    ratio_pairs: Sequence[tuple[str, str]],
    unit: str = "",
    group: Callable[[Benchmark], str] = lambda bench: family(bench.spec.name),
) -> list[str]:
    """The lines of a summary table: one row per benchmark metric with its
    name and ``describe(bench, metric)`` (headed by ``header``), the median
    of every configuration (headed by its label and ``unit``), then a
    ``<label>/<baseline>`` column per pair of ``ratio_pairs``, filled by
    ``ratio(bench, metric, label, baseline)``; a rule wherever ``group``
    changes (default: between benchmark families)."""
    labels = report.config.labels
    head = [*header, *(f"{label}{unit}" for label in labels),
            *(f"{label}/{baseline}" for label, baseline in ratio_pairs)]
    rows: list[list[str]] = []
    rules = [1]
    previous: str | None = None
    for bench in report.config.benchmarks:
        if previous is not None and group(bench) != previous:
            rules.append(len(rows) + 1)
        previous = group(bench)
        rows.extend(
            [
                bench.spec.name,
                describe(bench, metric),
                *(median_cell(report, bench, metric, label) for label in labels),
                *(format_ratio(ratio(bench, metric, label, baseline))
                  for label, baseline in ratio_pairs),
            ]
            for metric in bench.metrics
        )
    return align([head, *rows], label_columns=2, rules=rules)


def align(rows: list[list[str]], label_columns: int, rules: Sequence[int] = (1,)) -> list[str]:
    """Left-align the first ``label_columns`` columns, right-align the
    numbers; a dashed rule goes before each row index in ``rules``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < label_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
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
        *build_notes(report),
        machine_note(report),
    ]
    return notes + problem_notes(report)


def idle_footnote(spec: BenchSpec, baseline: str) -> str:
    """What the idle number is, and which way its ratio points."""
    return (
        f"{spec.name}: CPU seconds (user+sys) of a whole idle LocalCluster(protocol=<scheme>, "
        f"n_workers={N_WORKERS}, processes=True) plus Client, i.e. of its process tree "
        f"(scheduler, client and nannies in one process, one process per worker), over "
        f"{spec.duration_s:g} s after {spec.settle_s:g} s of settling, scaled to "
        f"{IDLE_PER_S:g} s; lower is better, so the ratio is {baseline}/<x>: "
        f">1 means <x> burns less CPU while idle."
    )


def build_notes(report: Report) -> list[str]:
    """Which build of :data:`PACKAGE` each configuration with a
    ``pythonpath`` ran, as a child of it reported (see
    :func:`probe_configurations`)."""
    return [
        f"{c.label}: {report.status[c.label].detail}, in every process of it (peers; "
        f"clusters and their workers); the other configurations: {PACKAGE} from "
        f"{report.environment.get(PACKAGE, 'unknown')}."
        for c in report.config.configurations
        if c.pythonpath and report.status[c.label].available
    ]


def machine_note(report: Report) -> str:
    """Where and what was measured, in one line."""
    env = report.environment
    settings = env["lci_settings"]
    providers = ", ".join(settings["providers"]) if isinstance(settings, dict) else settings
    return (f"Measured: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']:g} GiB, "
            f"load average {env['load_average'][0]:g} at the start (other work on the machine "
            f"adds noise), Python {env['python']}, distributed {env['distributed']}; "
            f"code {env['source']}, lci providers [{providers}].")


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


def environment_facts() -> dict[str, Any]:
    """The machine, the versions and the code measured, plus any lci knobs
    the harness inherited: those silently change every lci configuration."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "distributed": distributed.__version__,
        "numpy": numpy.__version__,
        "source": _source_revision(),
        PACKAGE: _package_dir(),
        "lci_settings": _lci_settings(),
        "argv": sys.argv,
        "inherited_lci_env": {k: v for k, v in os.environ.items() if k.startswith(LCI_ENV_PREFIX)},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _lci_settings() -> dict[str, Any] | str:
    """The lci:// settings every configuration starts from (defaults plus
    the inherited environment), or why they are invalid."""
    from dask_lcicomm.config import Settings

    try:
        return asdict(Settings.from_config())
    except ValueError as exc:
        return _one_line(exc)


def _package_dir() -> str:
    """Where this process (and every configuration without a ``pythonpath``)
    finds :data:`PACKAGE`."""
    spec = importlib.util.find_spec(PACKAGE)
    origin = spec.origin if spec else None
    return os.path.dirname(origin) if origin else "unknown"


def _source_revision(where: str | None = None) -> str:
    """The commit of the code in ``where`` (default: the code measured),
    marked ``-dirty`` when the work tree differs from it: numbers of
    uncommitted code are not the commit's."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10,
                              cwd=where or os.path.dirname(__file__))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
