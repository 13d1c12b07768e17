"""Real Dask graphs on a ``LocalCluster`` per scheme, plus an in-process
reference.

The comm benchmarks time the comm API alone; what a user sees is a whole
cluster -- scheduler, worker-to-worker transfers, gathers to the client, many
small task messages -- running on the backend.  So each configuration here is
a fresh ``LocalCluster(protocol=<scheme>, n_workers=2, threads_per_worker=1,
processes=True)`` in a child process (see :mod:`benchmarks._cluster`), on
which the same graphs (:mod:`benchmarks._graphs`) run, and the tables report
each graph's median wall time.  A ``LocalCluster(processes=False)``
(``inproc``: worker threads, no serialization) runs the same graphs as the
zero-communication reference: the gap between a scheme and ``inproc`` is what
communication costs at most.

The graphs come in two kinds: ``bulk`` ones that mostly move data (between
workers, to the client, all-to-all in a rechunk), where a comm can win
outright, and ``compute`` ones bound by computation or by the scheduler's
many small messages, where a comm can at best stay out of the way.

Each graph is run once at a tiny size on the same cluster before it is
timed, so imports on the workers and first connections are not billed to it.

Budget on 2 cores: the full run (3 rounds of lci, tcp and inproc) takes
about 8 minutes; ``--quick`` (one round, small sizes) well under a minute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks._cluster import INPROC, N_WORKERS, send_request, started_cluster
from benchmarks._comm_peers import Measurement
from benchmarks._configurations import STARTUP_TIMEOUT_S, Configuration, with_baseline_build
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
from benchmarks._harness import Benchmark, Metric, Outcome, Report, RunConfig, check_selection, report_answers
from benchmarks._harness import run as _run
from benchmarks._harness import to_json as _to_json
from benchmarks._procs import receive
from benchmarks._progress import SILENT, Progress
from benchmarks._tables import build_notes, machine_note, medians_table, problem_notes
from benchmarks.comm import BASELINE, DEFAULT_SCHEMES, ratio_pairs

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

#: The kinds of graph (see the module docstring), in table order.
BULK, COMPUTE = "bulk", "compute"


# ---------------------------------------------------------------------- suite


@dataclass(frozen=True)
class Graph:
    """A graph, its kind (:data:`BULK` or :data:`COMPUTE`), how to describe
    it, and its sizes as ``(warm-up, quick, full)``."""

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
    return Graph(
        f"rechunk-{method}", BULK, partial(measure_rechunk, method=method),
        lambda s: f"{_mib(8 * s.size**2)} float64 {s.size}x{s.size}, column blocks "
        f"{s.size}x{s.piece} -> row blocks {s.piece}x{s.size}, method={method!r}",
        size=(400, 1000, 12_000), piece=(100, 250, 1000),
    )


GRAPHS = (
    Graph("move", BULK, measure_move,
          lambda s: f"{_mib(s.size)} worker A -> B as {s.size // s.piece} x {_mib(s.piece)} "
          "arrays, np.sum on B",
          size=(4 * MiB, 64 * MiB, GiB), piece=(MiB, 16 * MiB, 128 * MiB)),
    Graph("gather", BULK, measure_gather,
          lambda s: f"{_mib(s.size)} worker -> client as {s.size // s.piece} x "
          f"{_mib(s.piece)} arrays",
          size=(4 * MiB, 64 * MiB, 2 * GiB), piece=(MiB, 16 * MiB, 256 * MiB)),
    _rechunk("tasks"),
    _rechunk("p2p"),
    Graph("array", COMPUTE, measure_array,
          lambda s: f"(x + x.T).sum(), x random {s.size}x{s.size} float64 "
          f"({_mib(8 * s.size**2)}), chunks {s.piece}",
          size=(400, 2000, 6000), piece=(200, 500, 1000)),
    Graph("shuffle", COMPUTE, measure_shuffle,
          lambda s: f"dataframe shuffle('key') of {s.size:,} rows in {s.size // s.piece} "
          "partitions",
          size=(10_000, 40_000, 1_000_000), piece=(2_500, 10_000, 100_000)),
    Graph("tree", COMPUTE, measure_tree,
          lambda s: f"delayed tree sum of {s.size} leaves, fan-in {s.piece}",
          size=(64, 128, 4096), piece=(8, 8, 8)),
    Graph("amt", COMPUTE, measure_amt,
          lambda s: f"1-D stencil, {s.piece} cells x {s.size} steps = {s.size * s.piece} "
          "tasks of 1 KiB, cell i on worker i % 2",
          size=(2, 4, 48), piece=(4, 8, 32)),
)

GRAPH_NAMES = tuple(g.name for g in GRAPHS)
_BY_NAME = {g.name: g for g in GRAPHS}


def _seconds(m: Measurement, spec: GraphSpec) -> float:
    return m.seconds


SECONDS = Metric("time", "s", False, _seconds)


def make_config(
    schemes: Sequence[str] | None = None,
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> RunConfig:
    """One configuration per scheme (de-duplicated, order kept; default
    those of ``comm``), ``lci@baseline`` (lci built in the directory
    ``baseline``, whose clusters' processes all import it from there) if
    given, then the ``inproc`` reference; 3 rounds, or 1 with ``quick``."""
    names = [s for s in dict.fromkeys(schemes or DEFAULT_SCHEMES) if s != INPROC]
    configurations = [*with_baseline_build([Configuration.of_scheme(s) for s in names], baseline),
                      Configuration.of_scheme(INPROC)]
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
                         label=configuration.label, dask_config=configuration.overrides,
                         pythonpath=configuration.pythonpath) as (cluster, _):
        for spec in specs:
            send_request(cluster, spec)
            yield spec, receive(cluster, spec.timeout_s)


def run(config: RunConfig, progress: Progress = SILENT) -> Report:
    """Every configuration once per round, rounds alternating (see the harness)."""
    return _run(config, run_round, progress, title="dask")


# ----------------------------------------------------------------- reporting


def time_ratio(report: Report, bench: Benchmark[GraphSpec], label: str, baseline: str) -> float | None:
    """Median time of ``label`` over that of ``baseline``: <1 means ``label``
    is faster."""
    return report.quotient(bench, SECONDS, label, baseline)


def format_table(report: Report) -> str:
    """One row per graph, bulk graphs first: median seconds per
    configuration, then the time ratios."""
    lines = medians_table(
        report, ("graph", "what"), lambda bench, metric: describe(bench),
        lambda bench, metric, label, baseline: time_ratio(report, bench, label, baseline),
        ratio_pairs(report.config.labels), unit=" [s]", group=kind,
    )
    return "\n".join([*lines, "", *_footnotes(report)])


def kind(bench: Benchmark[GraphSpec]) -> str:
    """:data:`BULK` or :data:`COMPUTE`."""
    return _BY_NAME[bench.spec.name].kind


def describe(bench: Benchmark[GraphSpec]) -> str:
    """What the graph does, at the size it ran."""
    return f"{kind(bench)}: {_BY_NAME[bench.spec.name].describe(bench.spec)}"


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
        f"Kinds: {BULK} graphs mostly move data; {COMPUTE} graphs are bound by computation "
        "or by the scheduler's many small messages.",
        "Timed: move and gather only the movement (and np.sum) of each piece, making it "
        "on worker A is untimed; rechunk from the persisted column blocks until the row "
        "blocks are in memory; amt from the first submission to the gathered last step; "
        "array and tree the whole compute; shuffle the shuffle and a row count of the "
        "persisted frame. Every graph first runs once at a tiny size on the same cluster "
        "(untimed warm-up: imports, first connections) and checks its result.",
    ]
    if ratio_pairs(config.labels):
        notes.append("Ratios: <x>/<y> of the median times: <1 means <x> is faster.")
    return [*notes, *build_notes(report), machine_note(report), *problem_notes(report)]


def to_json(report: Report) -> dict[str, Any]:
    """The harness's JSON (whose ``ratios`` are oriented, >1 = better) plus
    ``time_ratios``: <x>/<y> of the times as in the table, <1 = faster."""
    pairs = ratio_pairs(report.config.labels)
    data = _to_json(report, pairs)
    for result, bench in zip(data["results"], report.config.benchmarks, strict=True):
        result["description"] = describe(bench)
        result["kind"] = kind(bench)
        result["time_ratios"] = {
            f"{label}/{baseline}": time_ratio(report, bench, label, baseline)
            for label, baseline in pairs
        }
    return data
