"""Real Dask graphs on a fresh ``LocalCluster(n_workers=2)`` per scheme and round, beside
``LocalCluster(processes=False)`` (``inproc``: no communication, the floor a comm could reach).
Each times only its own part (its input is made untimed), in pieces, and checks its result."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks import _runner, comm
from benchmarks import _workload_suite as suite
from benchmarks._cluster import INPROC, cluster_answers
from benchmarks._comm_peers import Measurement
from benchmarks._contenders import Configuration
from benchmarks._runner import Benchmark, Metric, Record
from benchmarks._workload_suite import GraphSpec, MiB

GiB = 2**30
WARM_UP, QUICK, FULL = 0, 1, 2  # indices into a graph's size triples
_TIMEOUT_S = (60.0, 60.0, 300.0)
BULK, COMPUTE = "bulk", "compute"
TIME = Metric("time", "s", False)


@dataclass(frozen=True)
class Graph:
    """``size`` is the whole and ``piece`` what it is cut into (bytes, matrix or chunk side,
    leaves and fan-in, rows, steps and cells) for (warm-up, quick, full); ``what`` describes it."""

    name: str
    kind: str
    measure: Callable[[Any, GraphSpec], Measurement]
    what: str
    size: tuple[int, int, int]
    piece: tuple[int, int, int]

    def spec(self, budget: int) -> GraphSpec:
        return GraphSpec(self.name, self.size[budget], self.piece[budget], _TIMEOUT_S[budget])


GRAPHS = {g.name: g for g in (
    Graph("move", BULK, partial(suite.measure_piecewise, to_client=False),
          "{whole} worker A -> B as {pieces} x {each} arrays, np.sum on B",
          size=(4 * MiB, 64 * MiB, GiB), piece=(MiB, 16 * MiB, 128 * MiB)),
    Graph("gather", BULK, partial(suite.measure_piecewise, to_client=True),
          "{whole} worker -> client as {pieces} x {each} arrays",
          size=(4 * MiB, 64 * MiB, 2 * GiB), piece=(MiB, 16 * MiB, 256 * MiB)),
    *(Graph(f"rechunk-{method}", BULK, partial(suite.measure_rechunk, method=method),
            "{matrix} float64 {s.size}x{s.size}, column blocks {s.size}x{s.piece} -> row blocks "
            "{s.piece}x{s.size}, method=" + repr(method),
            size=(400, 1000, 12_000), piece=(100, 250, 1000)) for method in ("tasks", "p2p")),
    Graph("array", COMPUTE, suite.measure_array,
          "(x + x.T).sum(), x random {s.size}x{s.size} float64 ({matrix}), chunks {s.piece}",
          size=(400, 2000, 6000), piece=(200, 500, 1000)),
    Graph("shuffle", COMPUTE, suite.measure_shuffle,
          "dataframe shuffle('key') of {s.size:,} rows in {pieces} partitions",
          size=(10_000, 40_000, 1_000_000), piece=(2_500, 10_000, 100_000)),
    Graph("tree", COMPUTE, suite.measure_tree, "delayed tree sum of {s.size} leaves, fan-in {s.piece}",
          size=(64, 128, 4096), piece=(8, 8, 8)),
    Graph("amt", COMPUTE, suite.measure_amt, "1-D stencil, {s.piece} cells x {s.size} steps = {tasks} "
          "tasks of 1 KiB, cell i on worker i % 2", size=(2, 4, 48), piece=(4, 8, 32)),
)}


def answer_graph(client: Any, spec: GraphSpec) -> tuple[str, str, Any]:
    """Cluster child: warm up at a tiny size, then time ``spec``; a failure keeps the cluster."""
    graph = GRAPHS[spec.name]
    try:
        graph.measure(client, graph.spec(WARM_UP))
        return ("result", spec.name, graph.measure(client, spec))
    except Exception as exc:
        return ("error", spec.name, _runner.one_line(exc))


def run_round(c: Configuration, benches: list[Benchmark], index: int,
              record: Callable[[Record], None]) -> None:
    """Every graph, one after the other, on one fresh cluster."""
    specs = [b.spec for b in benches]
    _runner.record_answers(c.label, index, specs, cluster_answers(c, answer_graph, specs), record,
                           lambda _, m: ({"time": m.seconds}, {"count": m.count, "seconds": m.seconds}))


def describe(bench: Benchmark, metric: Metric | None = None) -> str:
    graph, s = GRAPHS[bench.name], bench.spec
    return f"{graph.kind}: " + graph.what.format(
        s=s, pieces=s.size // s.piece, tasks=s.size * s.piece, whole=_mib(s.size),
        each=_mib(s.piece), matrix=_mib(8 * s.size**2))


def _mib(nbytes: int) -> str:
    return f"{nbytes / GiB:.3g} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def configurations(schemes: Sequence[str], baseline: str | None = None) -> list[Configuration]:
    """The schemes, ``lci@baseline`` if asked for, then the in-process reference."""
    return [*comm.configurations([s for s in schemes if s != INPROC], baseline),
            Configuration.of_scheme(INPROC)]


def main(argv: Sequence[str] | None = None) -> int:
    p = _runner.parser("dask", __doc__, tuple(GRAPHS), "3, quick: 1")
    p.add_argument("--schemes", type=_runner.csv, metavar="SCHEMES",
                   help=f"comma-separated (default: {','.join(comm.SCHEMES)}; {INPROC} always runs)")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    try:
        chosen = configurations(args.schemes or comm.SCHEMES, args.baseline)
    except ValueError as exc:
        p.error(str(exc))
    benches = [Benchmark(GRAPHS[name].spec(QUICK if args.quick else FULL), (TIME,), GRAPHS[name].kind)
               for name in args.benchmarks or GRAPHS]
    result = _runner.run("dask", chosen, benches, rounds, args.quick, run_round)
    pairs = comm.ratio_pairs(result.labels)
    data = _runner.to_json(result, pairs)
    for entry, bench in zip(data["results"], result.benchmarks, strict=True):
        entry["description"] = describe(bench)
    text = _runner.table(result, ("graph", "what"), describe, pairs, quotients=True, unit=" [s]")
    return _runner.finish(args, text, data)
