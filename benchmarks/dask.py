"""Real Dask graphs on a fresh ``LocalCluster(n_workers=2)`` per scheme and round, beside
``LocalCluster(processes=False)`` (``inproc``: no communication, the floor a comm could reach).
Each times only its own part (its input is made untimed), in pieces, and checks its result."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np
from distributed import wait

from benchmarks import _runner
from benchmarks._cluster import INPROC, send_request, started_cluster, workers
from benchmarks._comm_peers import Measurement
from benchmarks._contenders import Configuration, with_baseline
from benchmarks._procs import PeerError, receive
from benchmarks._runner import Benchmark, Metric, Record
from benchmarks.comm import SCHEMES, ratio_pairs

MiB, GiB = 2**20, 2**30
WARM_UP, QUICK, FULL = 0, 1, 2  # indices into a graph's size triples
_TIMEOUT_S = (60.0, 60.0, 300.0)
BULK, COMPUTE = "bulk", "compute"
TIME = Metric("time", "s", False)


@dataclass(frozen=True)
class GraphSpec:
    """One graph at one size: what the cluster child is asked to run."""

    name: str
    size: int
    piece: int
    timeout_s: float


def _check(got: Any, expected: Any, close: bool = False) -> None:
    """A wrong result must not pass for a fast one (``close``: floats summed in another order)."""
    if not (np.allclose(got, expected) if close else got == expected):
        raise AssertionError(f"wrong result: {got!r}, expected {expected!r}")


def _computed(client: Any, collection: Any, expected: Any, close: bool = False) -> Measurement:
    """Time computing ``collection``, then check its result."""
    start = perf_counter()
    got = client.compute(collection).result()
    seconds = perf_counter() - start
    _check(got, expected, close)
    return Measurement(1, seconds)


def _persisted(client: Any, collection: Any) -> Any:
    collection = client.persist(collection)
    wait(collection)
    return collection


def _on(client: Any, worker: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` as a task that runs on ``worker`` and nowhere else."""
    return client.submit(function, *args, workers=[worker], allow_other_workers=False, pure=False)


def _random_bytes(nbytes: int) -> np.ndarray:
    """Data no backend can compress (a random MiB repeated: beyond lz4's 64 KiB window), made
    in ~60% of the time fully random GiBs would take (untimed, but it lengthens every round)."""
    block = np.random.default_rng().integers(0, 256, min(nbytes, MiB), dtype=np.uint8)
    return np.resize(block, nbytes)


def measure_piecewise(client: Any, spec: GraphSpec, to_client: bool) -> Measurement:
    """Time moving each piece made on the first worker to the client, or to the other worker
    (np.sum there); each is released before the next (256 MiB pieces: ~1 GiB alive)."""
    source, other = workers(client)[:2]
    seconds = 0.0
    for _ in range(spec.size // spec.piece):
        made = _on(client, source, _random_bytes, spec.piece)
        wait(made)
        start = perf_counter()
        if to_client:
            client.gather(made)
        else:
            _on(client, other, np.sum, made).result()
        seconds += perf_counter() - start
        del made
    return Measurement(spec.size // spec.piece, seconds)


def measure_rechunk(client: Any, spec: GraphSpec, method: str) -> Measurement:
    """Column blocks to row blocks: all-to-all, half of it between workers."""
    import dask.array as da

    columns = _persisted(client, da.random.random((spec.size, spec.size),
                                                  chunks=(spec.size, spec.piece)))
    expected = client.compute(columns.sum()).result()
    rows = columns.rechunk((spec.piece, spec.size), method=method)
    start = perf_counter()
    rows = _persisted(client, rows)
    seconds = perf_counter() - start
    del columns
    _check(client.compute(rows.sum()).result(), expected, close=True)
    return Measurement(1, seconds)


def measure_array(client: Any, spec: GraphSpec) -> Measurement:
    """``(x + x.T).sum()``: the transpose makes chunks cross workers."""
    import dask.array as da

    x = da.random.random((spec.size, spec.size), chunks=spec.piece)
    return _computed(client, (x + x.T).sum(), 2 * client.compute(x.sum()).result(), close=True)


def _random_frame(seed: int, rows: int) -> Any:
    """One partition, made on the worker: not shipped in the graph (1M rows: 15 MiB of it)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, 1000, rows), "value": rng.random(rows)})


def measure_shuffle(client: Any, spec: GraphSpec) -> Measurement:
    """Shuffle on ``key`` (P2P on a cluster) and count rows per partition:
    ``len`` alone would be optimised into skipping the shuffle."""
    import dask.dataframe as dd

    data = _persisted(client, dd.from_map(_random_frame, range(spec.size // spec.piece),
                                          rows=spec.piece))
    return _computed(client, data.shuffle("key").map_partitions(len).sum(), spec.size)


def measure_tree(client: Any, spec: GraphSpec) -> Measurement:
    """Delayed sums of ``piece`` values, level by level: tiny tasks, so messages dominate."""
    import dask

    level = [dask.delayed(int)(i) for i in range(spec.size)]  # a task per leaf
    while len(level) > 1:
        level = [dask.delayed(sum)(level[i:i + spec.piece])
                 for i in range(0, len(level), spec.piece)]
    return _computed(client, level[0], spec.size * (spec.size - 1) // 2)


def _stencil(left: np.ndarray, middle: np.ndarray, right: np.ndarray) -> np.ndarray:
    """One step of one cell: a 3-point average over its ring neighbours."""
    return (left + 2 * middle + right) / 4


def measure_amt(client: Any, spec: GraphSpec) -> Measurement:
    """HPX's 1d_stencil: ``piece`` cells on a ring for ``size`` steps, a task per cell and
    step, cell ``i`` on worker ``i % 2``: every dependency crosses workers."""
    steps, cells, points = spec.size, spec.piece, 128  # 1 KiB a cell: a task's whole payload
    pinned = workers(client)
    home = [pinned[i % len(pinned)] for i in range(cells)]
    start = perf_counter()
    row = [_on(client, home[i], np.full, points, float(i)) for i in range(cells)]
    for _ in range(steps):
        row = [_on(client, home[i], _stencil, row[i - 1], row[i], row[(i + 1) % cells])
               for i in range(cells)]
    result = client.gather(row)
    seconds = perf_counter() - start
    grid = np.stack([np.full(points, float(i)) for i in range(cells)])
    for _ in range(steps):
        grid = _stencil(np.roll(grid, 1, axis=0), grid, np.roll(grid, -1, axis=0))
    _check(np.stack(result), grid, close=True)
    return Measurement(steps * cells, seconds)


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
    Graph("move", BULK, partial(measure_piecewise, to_client=False),
          "{whole} worker A -> B as {pieces} x {each} arrays, np.sum on B",
          size=(4 * MiB, 64 * MiB, GiB), piece=(MiB, 16 * MiB, 128 * MiB)),
    Graph("gather", BULK, partial(measure_piecewise, to_client=True),
          "{whole} worker -> client as {pieces} x {each} arrays",
          size=(4 * MiB, 64 * MiB, 2 * GiB), piece=(MiB, 16 * MiB, 256 * MiB)),
    *(Graph(f"rechunk-{method}", BULK, partial(measure_rechunk, method=method),
            "{matrix} float64 {s.size}x{s.size}, column blocks {s.size}x{s.piece} -> row blocks "
            "{s.piece}x{s.size}, method=" + repr(method),
            size=(400, 1000, 12_000), piece=(100, 250, 1000)) for method in ("tasks", "p2p")),
    Graph("array", COMPUTE, measure_array,
          "(x + x.T).sum(), x random {s.size}x{s.size} float64 ({matrix}), chunks {s.piece}",
          size=(400, 2000, 6000), piece=(200, 500, 1000)),
    Graph("shuffle", COMPUTE, measure_shuffle,
          "dataframe shuffle('key') of {s.size:,} rows in {pieces} partitions",
          size=(10_000, 40_000, 1_000_000), piece=(2_500, 10_000, 100_000)),
    Graph("tree", COMPUTE, measure_tree, "delayed tree sum of {s.size} leaves, fan-in {s.piece}",
          size=(64, 128, 4096), piece=(8, 8, 8)),
    Graph("amt", COMPUTE, measure_amt, "1-D stencil, {s.piece} cells x {s.size} steps = {tasks} "
          "tasks of 1 KiB, cell i on worker i % 2", size=(2, 4, 48), piece=(4, 8, 32)),
)}


def answer_graph(client: Any, spec: GraphSpec) -> tuple[str, str, Any]:
    """Cluster child: warm up at a tiny size, then time ``spec``; a failure keeps the cluster."""
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)  # a WARNING per P2P shuffle
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
    graph, s = GRAPHS[bench.name], bench.spec
    return f"{graph.kind}: " + graph.what.format(
        s=s, pieces=s.size // s.piece, tasks=s.size * s.piece, whole=_mib(s.size),
        each=_mib(s.piece), matrix=_mib(8 * s.size**2))


def _mib(nbytes: int) -> str:
    return f"{nbytes / GiB:.3g} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


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
    rounds = args.rounds or (1 if args.quick else 3)
    try:
        chosen = configurations(args.schemes or SCHEMES, args.baseline)
    except ValueError as exc:
        p.error(str(exc))
    benches = [Benchmark(GRAPHS[name].spec(QUICK if args.quick else FULL), (TIME,))
               for name in args.benchmarks or GRAPHS]
    result = _runner.run("dask", chosen, benches, rounds, args.quick, run_round)
    pairs = ratio_pairs(result.labels)
    data = _runner.to_json(result, pairs)
    for entry, bench in zip(data["results"], result.benchmarks, strict=True):
        entry |= {"description": describe(bench), "kind": GRAPHS[bench.name].kind}
    text = _runner.table(result, ("graph", "what"), describe, pairs, quotients=True,
                         unit=" [s]", group=lambda b: GRAPHS[b.name].kind)
    return _runner.finish(args, text, data)
