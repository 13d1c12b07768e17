"""The suite of ``comm`` and ``variants``: the LCI paper's ping-pong, flood
and nchains on Dask's Comm API, plus ``idle``, and how one configuration
runs them in one round.

* Each round starts a fresh server process and a fresh client process (see
  :mod:`benchmarks._procs`): peers never share an interpreter or a GIL, and a
  backend's process-global state cannot leak from one round into the next --
  which is also what lets a configuration be just per-process Dask config.
* The ``idle`` benchmark is the exception to "comms only": it measures the CPU
  time a whole idle ``LocalCluster`` burns (see :mod:`benchmarks._idle`),
  because a backend that is fast only by spinning costs every other job on
  the node.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any

from benchmarks._comm_peers import BenchSpec, Measurement, Server, client_main, server_main
from benchmarks._configurations import STARTUP_TIMEOUT_S, Configuration, await_server
from benchmarks._floor_comm import SCHEME as FLOOR
from benchmarks._harness import Benchmark, Metric, Outcome, RunConfig, check_selection, report_answers
from benchmarks._idle import IDLE_KIND, measure_idle
from benchmarks._procs import PeerError, receive, spawned

MiB = 2**20


#: Extra seconds beyond ``duration_s`` before a benchmark counts as hung
#: (covers connecting, warm-up and one final slow iteration; idle: settling).
_SLACK_S = {True: 15.0, False: 60.0}  # keyed by ``quick``


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


def run_comm_round(
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
            on_outcome(run_idle(spec, configuration, round_index))


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
        client.conn.send((Server(await_server(server), configuration.provider), specs))
        deadline = monotonic() + STARTUP_TIMEOUT_S + sum(s.timeout_s for s in specs)
        for spec in specs:
            yield spec, receive(client, deadline - monotonic())
        server.conn.close()  # let the server wind down while the client exits


def run_idle(spec: BenchSpec, configuration: Configuration, round_index: int) -> Outcome:
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
