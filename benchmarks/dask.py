"""Real Dask graphs on a ``LocalCluster`` per scheme, plus an in-process
reference.

The comm benchmarks time the comm API alone; what a user sees is a whole
cluster -- scheduler, worker-to-worker transfers, gathers to the client, many
small task messages -- running on the backend.  So each configuration here is
a fresh ``LocalCluster(protocol=<scheme>, n_workers=2, threads_per_worker=1,
processes=True)`` in a child process (see :mod:`benchmarks._cluster`), on
which the same graphs run, and the tables report each graph's median wall
time.  A ``LocalCluster(processes=False)`` (``inproc``: worker threads, no
serialization) runs the same graphs as the zero-communication reference: the
gap between a scheme and ``inproc`` is what communication costs at most.

Each graph is run once at a tiny size on the same cluster before it is
timed, so imports on the workers and first connections are not billed to it.
Data that only has to exist before the timed part (the arrays to move, the
frame to shuffle) is made untimed, and big movements go piece by piece, each
piece released before the next, to keep the peak memory at a few pieces.

Budget on 2 cores: the full run (3 rounds of lci, tcp and inproc) takes
about 5 minutes; ``--quick`` (one round, small sizes) well under a minute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np
from distributed import wait

from benchmarks._cluster import (
    INPROC,
    N_WORKERS,
    send_request,
    started_cluster,
    workers,
)
from benchmarks._comm_peers import Measurement
from benchmarks._harness import (
    STARTUP_TIMEOUT_S,
    Benchmark,
    Configuration,
    Metric,
    Outcome,
    Report,
    RunConfig,
    check_selection,
    medians_table,
    problem_notes,
    report_answers,
)
from benchmarks._harness import run as _run
from benchmarks._harness import to_json as _to_json
from benchmarks._procs import receive
from benchmarks.comm import BASELINE, ratio_schemes

__all__ = ["GRAPH_NAMES", "BASELINE", "make_config", "run", "format_table", "to_json"]

MiB = 2**20
GiB = 2**30

#: Rounds when ``--rounds`` is not given, as ``(quick, full)``.
DEFAULT_ROUNDS = (1, 3)

#: Indices into a :class:`Graph`'s size triples.
WARM_UP, QUICK, FULL = 0, 1, 2

#: Seconds one graph (warm-up included) may take, by budget index, before
#: its cluster counts as hung.
_TIMEOUT_S = (60.0, 60.0, 300.0)


@dataclass(frozen=True)
class GraphSpec:
    """One graph at one size; sent to the cluster child, recorded in the JSON.

    ``size`` is the whole amount and ``piece`` what it is cut into, in the
    graph's own unit: bytes (move, gather), matrix side (array), leaves and
    fan-in (tree), rows and rows per partition (shuffle).
    """

    name: str
    size: int
    piece: int
    timeout_s: float


# ------------------------------------------------------- graphs (cluster child)


def _timed(compute: Callable[[], Any]) -> float:
    """Wall seconds ``compute()`` took; its result is dropped at once."""
    start = perf_counter()
    compute()
    return perf_counter() - start


def _random_bytes(nbytes: int) -> np.ndarray:
    """Data no backend can compress (a random MiB repeated: far beyond lz4's
    64 KiB window), made in ~60% of the time fully random GiBs would take
    (untimed, but it lengthens every round)."""
    block = np.random.default_rng().integers(0, 256, min(nbytes, MiB), dtype=np.uint8)
    return np.resize(block, nbytes)


def _piecewise(client: Any, spec: GraphSpec, use: Callable[[Any, Any, str], Any]) -> Measurement:
    """Make ``spec.size`` bytes on the first worker piece by piece (untimed)
    and time ``use(client, future, other_worker)`` on each piece.

    Each piece is released before the next one is made: with 256 MiB pieces
    the copies alive at any time (maker, receiver, frames) stay around 1 GiB.
    """
    source, other = workers(client)[:2]
    count, seconds = 0, 0.0
    for _ in range(spec.size // spec.piece):
        made = client.submit(_random_bytes, spec.piece, workers=[source],
                             allow_other_workers=False, pure=False)
        wait(made)
        seconds += _timed(partial(use, client, made, other))
        del made
        count += 1
    return Measurement(count, seconds)


def _sum_on(client: Any, piece: Any, worker: str) -> Any:
    """``np.sum`` of ``piece`` on ``worker`` only: the piece has to travel."""
    return client.submit(np.sum, piece, workers=[worker], allow_other_workers=False,
                         pure=False).result()


def _gather(client: Any, piece: Any, worker: str) -> Any:
    """The piece itself, in the client."""
    return client.gather(piece)


def measure_move(client: Any, spec: GraphSpec) -> Measurement:
    return _piecewise(client, spec, _sum_on)


def measure_gather(client: Any, spec: GraphSpec) -> Measurement:
    return _piecewise(client, spec, _gather)


def measure_array(client: Any, spec: GraphSpec) -> Measurement:
    """``(x + x.T).sum()``: the transpose makes chunks cross workers."""
    import dask.array as da

    x = da.random.random((spec.size, spec.size), chunks=spec.piece)
    return Measurement(1, _timed(lambda: client.compute((x + x.T).sum()).result()))


def _leaf(index: int) -> int:
    return index


def measure_tree(client: Any, spec: GraphSpec) -> Measurement:
    """Sums of ``spec.piece`` delayed values, level by level, down to one:
    thousands of tiny tasks, so scheduler and worker messages dominate."""
    import dask

    level = [dask.delayed(_leaf)(i) for i in range(spec.size)]
    while len(level) > 1:
        level = [dask.delayed(sum)(level[i:i + spec.piece])
                 for i in range(0, len(level), spec.piece)]
    (total,) = level
    expected = spec.size * (spec.size - 1) // 2
    return Measurement(1, _timed(lambda: _check(client.compute(total).result(), expected)))


def _random_frame(seed: int, rows: int) -> Any:
    """One partition: pandas made on the worker, so that the frame is not
    shipped inside the graph (a 1M-row graph is 15 MiB through the scheduler)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, 1000, rows), "value": rng.random(rows)})


def measure_shuffle(client: Any, spec: GraphSpec) -> Measurement:
    """Shuffle a persisted frame of pandas partitions on ``key`` with Dask's
    default method (P2P on a cluster), then count rows per partition.

    Not ``len(shuffled)``: Dask's optimizer knows a shuffle keeps the length
    and would skip it.
    """
    import dask.dataframe as dd

    _quiet_shuffle_log()
    data = client.persist(dd.from_map(_random_frame, range(spec.size // spec.piece),
                                      rows=spec.piece))
    wait(data)
    rows = data.shuffle("key").map_partitions(len).sum()
    return Measurement(1, _timed(lambda: _check(client.compute(rows).result(), spec.size)))


def _quiet_shuffle_log() -> None:
    """The scheduler (in this process) logs a WARNING for every P2P shuffle
    started and finished: routine here, and it would drown the progress lines."""
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)


def _check(got: Any, expected: Any) -> None:
    """A wrong result must not pass for a fast one."""
    if got != expected:
        raise AssertionError(f"wrong result: {got!r}, expected {expected!r}")


# ---------------------------------------------------------------------- suite


@dataclass(frozen=True)
class Graph:
    """A graph, how to describe it, and its sizes as ``(warm-up, quick, full)``."""

    name: str
    measure: Callable[[Any, GraphSpec], Measurement]
    describe: Callable[[GraphSpec], str]
    size: tuple[int, int, int]
    piece: tuple[int, int, int]

    def spec(self, budget: int) -> GraphSpec:
        return GraphSpec(self.name, self.size[budget], self.piece[budget], _TIMEOUT_S[budget])


def _mib(nbytes: int) -> str:
    return f"{nbytes / GiB:g} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


GRAPHS = (
    Graph("move", measure_move,
          lambda s: f"{_mib(s.size)} worker A -> B as {s.size // s.piece} x {_mib(s.piece)} "
          "arrays, np.sum on B",
          size=(4 * MiB, 64 * MiB, GiB), piece=(MiB, 16 * MiB, 128 * MiB)),
    Graph("gather", measure_gather,
          lambda s: f"{_mib(s.size)} worker -> client as {s.size // s.piece} x "
          f"{_mib(s.piece)} arrays",
          size=(4 * MiB, 64 * MiB, 2 * GiB), piece=(MiB, 16 * MiB, 256 * MiB)),
    Graph("array", measure_array,
          lambda s: f"(x + x.T).sum(), x random {s.size}x{s.size} float64 "
          f"({_mib(8 * s.size**2)}), chunks {s.piece}",
          size=(400, 2000, 6000), piece=(200, 500, 1000)),
    Graph("tree", measure_tree,
          lambda s: f"delayed tree sum of {s.size} leaves, fan-in {s.piece}",
          size=(64, 512, 4096), piece=(8, 8, 8)),
    Graph("shuffle", measure_shuffle,
          lambda s: f"shuffle('key') of {s.size:,} rows in {s.size // s.piece} partitions",
          size=(10_000, 100_000, 1_000_000), piece=(2_500, 25_000, 100_000)),
)

GRAPH_NAMES = tuple(g.name for g in GRAPHS)
_BY_NAME = {g.name: g for g in GRAPHS}


def _seconds(m: Measurement, spec: Any) -> float:
    return m.seconds


SECONDS = Metric("time", "s", False, _seconds)


def make_config(
    schemes: Sequence[str],
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
) -> RunConfig:
    """One configuration per scheme (de-duplicated, order kept), then the
    ``inproc`` reference; 3 rounds, or 1 with ``quick``."""
    names = [s for s in dict.fromkeys(schemes) if s != INPROC] + [INPROC]
    configurations = [Configuration.of_scheme(s) for s in names]
    rounds = rounds or DEFAULT_ROUNDS[not quick]
    wanted = check_selection(configurations, rounds, only, GRAPH_NAMES, GRAPH_NAMES)
    budget = QUICK if quick else FULL
    return RunConfig(
        configurations=tuple(configurations),
        rounds=rounds,
        quick=quick,
        benchmarks=tuple(Benchmark(g.spec(budget), (SECONDS,)) for g in GRAPHS
                         if g.name in wanted),
    )


# ------------------------------------------------------------------- running


def answer_graph(client: Any, spec: GraphSpec) -> tuple[str, str, Any]:
    """Cluster child: warm up with the tiny graph, then time ``spec``.

    A failing graph is reported and the cluster kept for the next one.
    """
    graph = _BY_NAME[spec.name]
    try:
        graph.measure(client, graph.spec(WARM_UP))
        return ("result", spec.name, graph.measure(client, spec))
    except Exception as exc:
        return ("error", spec.name, f"{type(exc).__name__}: {exc}".splitlines()[0])


def run_round(
    config: RunConfig,
    configuration: Configuration,
    round_index: int,
    on_outcome: Callable[[Outcome], None],
) -> None:
    """All graphs, one after the other, on one fresh cluster."""
    specs = [b.spec for b in config.benchmarks]
    report_answers(_graph_answers(specs, configuration), specs, configuration.label,
                   round_index, on_outcome)


def _graph_answers(
    specs: list[GraphSpec], configuration: Configuration
) -> Generator[tuple[GraphSpec, Any], None, None]:
    """Each spec with the cluster child's report on it; the cluster is torn
    down when the generator finishes or is closed."""
    with started_cluster(configuration.scheme, answer_graph, STARTUP_TIMEOUT_S,
                         label=configuration.label,
                         dask_config=configuration.overrides) as (cluster, _):
        for spec in specs:
            send_request(cluster, spec)
            yield spec, receive(cluster, spec.timeout_s)


def run(config: RunConfig, progress: Callable[[str], None] = lambda line: None) -> Report:
    """Every configuration once per round, rounds alternating (see the harness)."""
    return _run(config, progress, run_round=run_round)


# ----------------------------------------------------------------- reporting


def time_ratio(report: Report, bench: Benchmark, label: str) -> float | None:
    """Median time of ``label`` over that of tcp: <1 means ``label`` is faster."""
    ours = report.median(bench, SECONDS, label)
    base = report.median(bench, SECONDS, BASELINE)
    return ours / base if ours and base else None


def format_table(report: Report) -> str:
    """One row per graph: median seconds per configuration, then the ratios."""
    lines = medians_table(
        report, ("graph", "what"), lambda bench, metric: _describe(bench),
        lambda bench, metric, label: time_ratio(report, bench, label),
        ratio_schemes(report.config), BASELINE, unit=" [s]",
    )
    return "\n".join([*lines, "", *_footnotes(report)])


def _describe(bench: Benchmark) -> str:
    return _BY_NAME[bench.spec.name].describe(bench.spec)


def _footnotes(report: Report) -> list[str]:
    config = report.config
    notes = [
        f"Values: wall seconds until the results are in, median over {config.rounds} "
        f"round(s) (even count: the slower middle value); lower is better. Rounds "
        f"alternate configurations ({', '.join(config.labels)}; order rotated each round), "
        f"each a fresh LocalCluster(protocol=<scheme>, n_workers={N_WORKERS}, "
        f"threads_per_worker=1, processes=True) with its Client in a child process on "
        f"127.0.0.1; {INPROC}: LocalCluster(processes=False) with the same workers as "
        f"threads of one process, no serialization: the zero-communication reference.",
        "Timed: move and gather only the movement (and np.sum) of each piece, making it "
        "on worker A is untimed; array and tree the whole compute; shuffle the shuffle "
        "and a row count of the persisted frame. Every graph first runs once at a tiny "
        "size on the same cluster (untimed warm-up: imports, first connections).",
    ]
    if ratio_schemes(config):
        notes.append(f"Ratios: <x>/{BASELINE} of the median times: <1 means <x> is faster.")
    return notes + problem_notes(report)


def to_json(report: Report) -> dict[str, Any]:
    """The harness's JSON (whose ``ratio_vs_baseline`` is tcp/<x>, >1 = better)
    plus ``time_ratio_vs_baseline``: <x>/tcp as in the table, <1 = faster."""
    data = _to_json(report, BASELINE if BASELINE in report.config.labels else None)
    for result, bench in zip(data["results"], report.config.benchmarks):
        result["description"] = _describe(bench)
        result["time_ratio_vs_baseline"] = {
            label: time_ratio(report, bench, label) for label in ratio_schemes(report.config)
        }
    return data
