"""Dask comms side by side: ping-pong 8 B .. 64 MiB, flood, nchains, an idle cluster's CPU.
The LCI paper's microbenchmarks; ``variants`` switches one lci knob (docs/benchmarks.md)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from time import monotonic
from typing import Any

from benchmarks import _runner
from benchmarks._cluster import measure_idle
from benchmarks._comm_peers import BenchSpec, Measurement, RunSpecs, Server, client_main, server_main
from benchmarks._contenders import BASELINE_BUILD, STARTUP_TIMEOUT_S, Configuration, with_baseline
from benchmarks._floor_comm import SCHEME as FLOOR
from benchmarks._procs import Peer, PeerError, expect, receive, spawned
from benchmarks._runner import Benchmark, Metric, Record, size_name

KiB, MiB = 2**10, 2**20
IDLE = "idle"

#: Idle CPU time is reported per this many seconds of idleness.
IDLE_PER_S = 10.0

LATENCY = Metric("latency", "us/round trip", False)
BANDWIDTH = Metric("bandwidth", "MiB/s, 2*size*n/t", True)
MESSAGES = Metric("rate", "messages/s", True)
ALL_CHAINS = Metric("rate", "round trips/s, all comms", True)
CHAIN_LATENCY = Metric("latency", "us/round trip, each comm", False)
IDLE_CPU = Metric("cpu", f"CPU s per {IDLE_PER_S:g} s idle", False)


def _plans(quick: bool, scale: float = 1.0) -> list[Benchmark]:
    """Every comm benchmark, its budgets given as ``(quick, full)`` pairs; ``scale`` shortens
    timed windows (not count caps) for long runs."""
    i = 0 if quick else 1

    def plan(name: str, kind: str, size: int, metrics: tuple[Metric, ...], duration: tuple[float, float],
             max_count: tuple[int, int], warmup: tuple[int, int], comms: int = 1,
             settle: tuple[float, float] = (0.0, 0.0)) -> Benchmark:
        timed = duration[i] * scale
        return Benchmark(BenchSpec(name, kind, size, timed, max_count[i], warmup[i],
                                   settle[i] + timed + (15.0 if quick else 60.0), comms, settle[i]), metrics)

    def pingpong(size: int) -> Benchmark:
        big = size >= 16 * MiB
        return plan(f"pingpong-{size_name(size)}", "pingpong", size, (LATENCY, BANDWIDTH),
                    (0.2, 1.5) if big else (0.05, 0.3), (200, 200_000),
                    (1, 1) if big else (2, 100 if size <= 64 * KiB else 5))

    return [
        *map(pingpong, (8, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)),
        *(plan(f"flood-{size_name(size)}-x{n}", "flood", size, (MESSAGES,), (0.05, 0.5),
               (500, 2_000_000), (2, 20), comms=n) for size in (8, 16 * KiB) for n in (1, 4, 16)),
        *(plan(f"nchains-{n}", "nchains", 8, (ALL_CHAINS, CHAIN_LATENCY), (0.05, 0.5),
               (5, 100_000), (1, 2), comms=n) for n in (1, 4, 16, 64, 256, 1024)),
        plan(IDLE, IDLE, 0, (IDLE_CPU,), (1.0, 10.0), (1, 1), (0, 0), settle=(0.5, 2.0)),
    ]


BENCHMARK_NAMES = tuple(b.name for b in _plans(quick=True))

#: What ``variants`` measures by default: the paper's table, and bandwidth.
VARIANT_BENCHMARKS = ("pingpong-8B", "flood-8B-x1", "flood-8B-x16", "nchains-64",
                      "pingpong-1MiB", "pingpong-64MiB")

LCI = "distributed.comm.lci"
OFI = {"ofi.provider": "tcp;ofi_rxm", "ofi.node": "127.0.0.1"}  # libfabric's tcp on loopback
OFI_MODULE = "dask_lcicomm.providers._ofi"


def variant(label: str, knobs: dict[str, Any], requires: str | None = None) -> Configuration:
    """lci with ``knobs`` (keys under :data:`LCI`) set in every process; a ``providers``
    variant is pinned to its first provider."""
    providers = knobs.get("providers")
    return Configuration(label, "lci", tuple((f"{LCI}.{k}", v) for k, v in knobs.items()),
                         provider=providers[0] if providers else None, requires=requires)


VARIANTS = {c.label: c for c in (
    variant("thread", {"progress": "thread"}),
    variant("thread-2", {"progress": "thread", "progress-threads": 2}),
    variant("sync", {"completion": "sync"}),
    variant("ndevices-2", {"ndevices": 2}),
    variant("ndevices-4", {"ndevices": 4}),
    variant("aggregation", {"aggregation": True}),
    variant("eager-0", {"eager-threshold": 0}),
    variant("eager-1MiB", {"eager-threshold": "1MiB"}),
    variant("fragment-256KiB", {"fragment-size": "256KiB"}),
    variant("fragment-4MiB", {"fragment-size": "4MiB"}),
    variant("poll-100us", {"shm.poll-window": "100us"}),
    variant("poll-500us", {"shm.poll-window": "500us"}),
    variant("poll-2ms", {"shm.poll-window": "2ms"}),
    variant("shm-reads", {"shm.pool-size": 0}),
    variant("shm-ring", {"shm.pool-size": 0, "shm.rendezvous-bytes": 0}),
    variant("providers-tcp", {"providers": ["tcp"]}),
    variant("providers-shm", {"providers": ["shm", "tcp"]}),
    variant("providers-ucx", {"providers": ["ucx", "tcp"]}, requires="ucxx"),
    variant("providers-ofi", {"providers": ["ofi", "tcp"], **OFI}, requires=OFI_MODULE),
    variant("providers-ofi-sends", {"providers": ["ofi", "tcp"], **OFI,
                                    "ofi.rendezvous-bytes": 0}, requires=OFI_MODULE),
)}

#: lci pinned to one provider: the fabric between hosts, UCX, libfabric.
PINNED = {label: replace(VARIANTS[f"providers-{label.removeprefix('lci-')}"], label=label)
          for label in ("lci-tcp", "lci-ucx", "lci-ofi")}
SCHEMES = ("lci", "tcp", "ucxx")
DEFAULT_NAMES = ("lci", *PINNED, "tcp", "ucxx")

#: Ratio columns beyond ``<x>/tcp``: the comparisons the project is judged on.
_EXTRA_PAIRS = (("lci", BASELINE_BUILD), ("lci", "ucxx"), ("lci-ucx", "ucxx"),
                ("lci-ofi", "ucxx"), ("lci-ofi", "lci-ucx"))


def configurations(names: Sequence[str], baseline: str | None = None) -> list[Configuration]:
    """A pinned lci or variant by label, else a scheme; plus ``lci@baseline``."""
    chosen = [PINNED.get(n) or VARIANTS.get(n) or Configuration.of_scheme(n)
              for n in dict.fromkeys(names)]
    return with_baseline(chosen, baseline)


def ratio_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    pairs = [(label, "tcp") for label in labels if "tcp" in labels and label != "tcp"]
    return pairs + [pair for pair in _EXTRA_PAIRS if set(pair) <= set(labels)]


def benchmarks(only: Sequence[str] | None, quick: bool, default: Sequence[str] = BENCHMARK_NAMES,
               scale: float = 1.0) -> list[Benchmark]:
    wanted = _runner.select(only, default, BENCHMARK_NAMES)
    return [b for b in _plans(quick, scale) if b.name in wanted]


def run_round(c: Configuration, benches: list[Benchmark], index: int,
              record: Callable[[Record], None]) -> None:
    """The comm benchmarks on one fresh server and client, both carrying the configuration,
    then ``idle`` on a cluster of its own once their peers are gone."""
    specs = [b.spec for b in benches if b.spec.kind != IDLE]

    def answers() -> Iterator[tuple[BenchSpec, Any]]:
        with started_pair(c, specs) as (_, client):
            deadline = monotonic() + STARTUP_TIMEOUT_S + sum(s.timeout_s for s in specs)
            for spec in specs:
                yield spec, receive(client, deadline - monotonic())

    if specs:
        _runner.record_answers(c.label, index, specs, answers(), record, _values)
    for bench in benches:
        if bench.spec.kind == IDLE:
            record(run_idle(bench.spec, c, index))


@contextmanager
def started_pair(c: Configuration, specs: list[BenchSpec], run_specs: RunSpecs | None = None
                 ) -> Iterator[tuple[Peer, Peer]]:
    """A fresh comm server and client carrying ``c``'s settings, the client given ``specs``
    (run by ``run_specs``, else the comm benchmarks' loop); both stopped on exit."""
    with (spawned(server_main, c.scheme, name=f"{c.label}-server", dask_config=c.overrides,
                  pythonpath=c.pythonpath) as server,
          spawned(client_main, run_specs, name=f"{c.label}-client", dask_config=c.overrides,
                  pythonpath=c.pythonpath) as client):
        (address,) = expect(server, "ready", STARTUP_TIMEOUT_S)
        client.conn.send((Server(address, c.provider), specs))
        yield server, client


def _values(spec: BenchSpec, m: Measurement) -> tuple[dict[str, float], dict[str, Any]]:
    """The measurement's metrics (see the ``Metric`` constants) and raw numbers."""
    per_s = m.count / m.seconds
    if spec.kind == IDLE:
        values = {"cpu": (m.cpu_seconds or 0.0) / m.seconds * IDLE_PER_S}
    elif spec.kind == "pingpong":
        values = {"latency": 1e6 / per_s, "bandwidth": 2 * spec.payload_bytes * per_s / MiB}
    elif spec.kind == "nchains":
        values = {"rate": per_s, "latency": spec.comms * 1e6 / per_s}
    else:
        values = {"rate": per_s}
    return values, asdict(m)


def run_idle(spec: BenchSpec, c: Configuration, index: int) -> Record:
    if c.scheme == FLOOR:
        return Record(spec.name, c.label, index, error="floor:// is a reference for the comm API "
                      "alone: no cluster runs on it")
    try:
        m = measure_idle(c, spec.settle_s, spec.duration_s, spec.timeout_s)
    except PeerError as exc:
        return Record(spec.name, c.label, index, error=str(exc))
    return Record(spec.name, c.label, index, *_values(spec, m))


def _unit(bench: Benchmark, metric: Metric) -> str:
    return metric.unit if metric.higher_is_better else f"{metric.unit} (lower=better)"


def variants_table(result: _runner.Run) -> str:
    """A row per variant, a column per benchmark: its ratio to default lci on the headline
    metric, under lci's absolute medians and their spread."""
    benches = result.benchmarks
    settings = {c.label: " ".join(f"{k.removeprefix(LCI + '.')}={json.dumps(v)}"
                                  for k, v in c.dask_config).replace('"', "") or f"{c.scheme}://"
                for c in result.configurations if c.label != "lci"}

    def spread(b: Benchmark) -> str:
        got = [v for v in result.values(b, b.metrics[0], "lci") if v]
        return _runner.format_ratio(max(got) / min(got) if len(got) > 1 else None)

    def cell(b: Benchmark, label: str) -> str:
        s = result.status[label]
        return _runner.format_ratio(result.ratio(b, b.metrics[0], label, "lci")) \
            if s.available else s.label

    rows = [["variant", "setting", *(b.name for b in benches)],
            ["", "", *(b.metrics[0].unit for b in benches)],
            ["lci (default)", "absolute medians",
             *(_runner.median_cell(result, b, b.metrics[0], "lci") for b in benches)],
            ["lci (default)", "spread: max/min of its rounds", *map(spread, benches)],
            *([label, setting, *(cell(b, label) for b in benches)]
              for label, setting in settings.items())]
    return "\n".join([*_runner.align(rows, 2, (2, 4)), "", *_runner.notes(result)])


def main(argv: Sequence[str] | None = None, command: str = "comm") -> int:
    is_variants = command == "variants"
    names = VARIANTS if is_variants else (*DEFAULT_NAMES, *VARIANTS)
    p = _runner.parser(command, __doc__.splitlines()[0], BENCHMARK_NAMES, "5, quick: 1")
    flag = "--variants" if is_variants else "--schemes"
    p.add_argument(flag, dest="names", metavar="NAMES",
                   type=_runner.subset(VARIANTS) if is_variants else _runner.csv,
                   help=f"comma-separated, of: {','.join(names)}; or any scheme")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    try:
        if is_variants:
            chosen = configurations(["lci", "tcp", *(args.names or VARIANTS)], args.baseline)
            benches = benchmarks(args.benchmarks, args.quick, VARIANT_BENCHMARKS,
                                 1.0 if args.quick else 0.5)
        else:
            chosen = configurations(args.names or DEFAULT_NAMES, args.baseline)
            benches = benchmarks(args.benchmarks, args.quick)
    except ValueError as exc:
        p.error(str(exc))
    result = _runner.run(command, chosen, benches, rounds, args.quick, run_round)
    pairs = ([(label, "lci") for label in result.labels if label != "lci"] if is_variants
             else ratio_pairs(result.labels))
    text = variants_table(result) if is_variants else _runner.table(
        result, ("benchmark", "metric [unit]"), _unit, pairs)
    return _runner.finish(args, text, _runner.to_json(result, pairs))
