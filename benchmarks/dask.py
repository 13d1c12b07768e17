"""Real Dask graphs on a fresh ``LocalCluster(n_workers=2)`` per scheme and
round, beside ``LocalCluster(processes=False)`` (``inproc``: no
communication, the floor a comm could reach): bulk graphs that move data,
compute graphs bound by computation or by the scheduler's small messages.

``python -m benchmarks dask [--schemes lci,tcp,ucxx] ...``; methodology in
``docs/benchmarks.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks import _runner
from benchmarks._cluster import INPROC, send_request, started_cluster
from benchmarks._comm_peers import Measurement, server_main
from benchmarks._contenders import Configuration, with_baseline
from benchmarks._graphs import (
    GraphSpec,
    measure_amt,
    measure_array,
    measure_gather,
    measure_move,
    measure_rechunk,
    measure_shuffle,
    measure_tree,
)
from benchmarks._procs import PeerError, receive
from benchmarks._runner import Benchmark, Metric, Record
from benchmarks.comm import SCHEMES, ratio_pairs

MiB, GiB = 2**20, 2**30
WARM_UP, QUICK, FULL = 0, 1, 2  # indices into a graph's size triples
_TIMEOUT_S = (60.0, 60.0, 300.0)
BULK, COMPUTE = "bulk", "compute"
TIME = Metric("time", "s", False)


@dataclass(frozen=True)
class Graph:
    """``size`` is the whole and ``piece`` what it is cut into, in the
    graph's unit (bytes, matrix or chunk side, leaves and fan-in, rows,
    steps and cells), as (warm-up, quick, full)."""

    name: str
    kind: str
    measure: Callable[[Any, GraphSpec], Measurement]
    describe: Callable[[GraphSpec], str]
    size: tuple[int, int, int]
    piece: tuple[int, int, int]

    def spec(self, budget: int) -> GraphSpec:
        return GraphSpec(self.name, self.size[budget], self.piece[budget], _TIMEOUT_S[budget])


def _mib(nbytes: int) -> str:
    return f"{nbytes / GiB:.3g} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def _rechunk(method: str) -> Graph:
    return Graph(f"rechunk-{method}", BULK, partial(measure_rechunk, method=method),
                 lambda s: f"{_mib(8 * s.size**2)} float64 {s.size}x{s.size}, column blocks "
                 f"{s.size}x{s.piece} -> row blocks {s.piece}x{s.size}, method={method!r}",
                 size=(400, 1000, 12_000), piece=(100, 250, 1000))


GRAPHS = {g.name: g for g in (
    Graph("move", BULK, measure_move,
          lambda s: f"{_mib(s.size)} worker A -> B as {s.size // s.piece} x {_mib(s.piece)} "
          "arrays, np.sum on B", size=(4 * MiB, 64 * MiB, GiB), piece=(MiB, 16 * MiB, 128 * MiB)),
    Graph("gather", BULK, measure_gather,
          lambda s: f"{_mib(s.size)} worker -> client as {s.size // s.piece} x "
          f"{_mib(s.piece)} arrays", size=(4 * MiB, 64 * MiB, 2 * GiB),
          piece=(MiB, 16 * MiB, 256 * MiB)),
    _rechunk("tasks"),
    _rechunk("p2p"),
    Graph("array", COMPUTE, measure_array,
          lambda s: f"(x + x.T).sum(), x random {s.size}x{s.size} float64 "
          f"({_mib(8 * s.size**2)}), chunks {s.piece}", size=(400, 2000, 6000),
          piece=(200, 500, 1000)),
    Graph("shuffle", COMPUTE, measure_shuffle,
          lambda s: f"dataframe shuffle('key') of {s.size:,} rows in {s.size // s.piece} "
          "partitions", size=(10_000, 40_000, 1_000_000), piece=(2_500, 10_000, 100_000)),
    Graph("tree", COMPUTE, measure_tree,
          lambda s: f"delayed tree sum of {s.size} leaves, fan-in {s.piece}",
          size=(64, 128, 4096), piece=(8, 8, 8)),
    Graph("amt", COMPUTE, measure_amt,
          lambda s: f"1-D stencil, {s.piece} cells x {s.size} steps = {s.size * s.piece} "
          "tasks of 1 KiB, cell i on worker i % 2", size=(2, 4, 48), piece=(4, 8, 32)),
)}


def answer_graph(client: Any, spec: GraphSpec) -> tuple[str, str, Any]:
    """Cluster child: warm up at a tiny size, then time ``spec``; a failing
    graph is reported and the cluster kept for the next one."""
    graph = GRAPHS[spec.name]
    try:
        graph.measure(client, graph.spec(WARM_UP))
        return ("result", spec.name, graph.measure(client, spec))
    except Exception as exc:
        return ("error", spec.name, _runner.one_line(exc))


def run_round(c: Configuration, benches: list[Benchmark], index: int,
              record: Callable[[Record], None]) -> None:
    """Every graph, one after the other, on one fresh cluster."""
    done = 0
    try:
        with started_cluster(c, answer_graph) as (cluster, _):
            for bench in benches:
                send_request(cluster, bench.spec)
                kind, name, payload = receive(cluster, bench.spec.timeout_s)
                record(Record(name, c.label, index, {"time": payload.seconds},
                              {"count": payload.count, "seconds": payload.seconds})
                       if kind == "result" else Record(name, c.label, index, error=payload))
                done += 1
    except PeerError as exc:
        for bench in benches[done:]:
            record(Record(bench.name, c.label, index, error=str(exc)))


def describe(bench: Benchmark, metric: Metric | None = None) -> str:
    graph = GRAPHS[bench.name]
    return f"{graph.kind}: {graph.describe(bench.spec)}"


def configurations(schemes: Sequence[str], baseline: str | None = None) -> list[Configuration]:
    """The schemes, ``lci@baseline`` if asked for, then the in-process reference."""
    names = [s for s in dict.fromkeys(schemes) if s != INPROC]
    return [*with_baseline([Configuration.of_scheme(s) for s in names], baseline),
            Configuration.of_scheme(INPROC)]


def main(argv: Sequence[str] | None = None) -> int:
    p = _runner.parser("dask", __doc__.splitlines()[0], tuple(GRAPHS), "3, quick: 1")
    p.add_argument("--schemes", type=_runner.csv, metavar="SCHEMES",
                   help=f"comma-separated (default: {','.join(SCHEMES)}; {INPROC} always runs)")
    args = p.parse_args(argv)
    try:
        chosen = configurations(args.schemes or SCHEMES, args.baseline)
        budget = QUICK if args.quick else FULL
        benches = [Benchmark(GRAPHS[name].spec(budget), (TIME,))
                   for name in _runner.select(args.benchmarks, tuple(GRAPHS), tuple(GRAPHS))]
        rounds = args.rounds or (1 if args.quick else 3)
        if rounds < 1:
            raise ValueError("rounds must be >= 1")
    except ValueError as exc:
        p.error(str(exc))
    result = _runner.run("dask", chosen, benches, rounds, args.quick, run_round, server_main)
    pairs = ratio_pairs(result.labels)
    data = _runner.to_json(result, pairs)
    for entry, bench in zip(data["results"], result.benchmarks, strict=True):
        entry |= {"description": describe(bench), "kind": GRAPHS[bench.name].kind,
                  "time_ratios": {f"{a}/{b}": result.quotient(bench, TIME, a, b)
                                  for a, b in pairs}}
    text = _runner.table(result, ("graph", "what"), describe, pairs, quotients=True,
                         unit=" [s]", group=lambda b: GRAPHS[b.name].kind)
    return _runner.finish(args, text, data)
