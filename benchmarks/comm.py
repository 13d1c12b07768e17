"""Side-by-side benchmarks of Dask comm backends (``lci``, ``tcp``, ``ucxx``):
the LCI paper's microbenchmarks on Dask's Comm API.

* ping-pong sweep, 8 B .. 64 MiB: latency where small, bandwidth where large;
* flood: message rate of one-way writes, 8 B and 16 KiB, 1, 4 and 16
  concurrent senders (comms);
* nchains: 1 .. 1024 comms doing round trips at once: latency under load;
* idle: the CPU time an idle ``LocalCluster`` burns.

The special case of :mod:`benchmarks._harness` where every configuration is a
plain scheme, with whatever environment the harness itself was started in --
plus, with ``baseline``, lci as built in another directory (``lci@baseline``,
see :func:`benchmarks._harness.baseline_build`).  The table has one row per
benchmark metric and one column per configuration, plus ``<label>/tcp``
ratio columns, ``lci/lci@baseline`` and ``lci/ucxx`` when both take part.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks._comm_peers import BenchSpec
from benchmarks._harness import (
    BASELINE_BUILD,
    BENCHMARK_NAMES,
    IDLE_PER_S,
    Configuration,
    Report,
    RunConfig,
    common_footnotes,
    make_run_config,
    medians_table,
    unit_label,
    with_baseline_build,
)
from benchmarks._harness import run as _run
from benchmarks._harness import to_json as _to_json
from benchmarks._idle import IDLE_KIND, N_WORKERS
from benchmarks._progress import SILENT, Progress

__all__ = ["BENCHMARK_NAMES", "BASELINE", "DEFAULT_SCHEMES", "make_config", "run",
           "format_table", "to_json", "ratio_pairs"]

#: The scheme that ratio columns divide by.
BASELINE = "tcp"

#: What runs when no schemes are given: ucxx shows as "not installed" where
#: the ``ucx`` extra is missing.
DEFAULT_SCHEMES = ("lci", "tcp", "ucxx")

#: Ratio columns beyond ``<x>/tcp``: this build against an earlier one, and
#: the comparisons the project is judged on.
_EXTRA_PAIRS = (("lci", BASELINE_BUILD), ("lci", "ucxx"))


def make_config(
    schemes: Sequence[str] | None = None,
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> RunConfig:
    """One configuration per scheme (de-duplicated, order kept; default
    :data:`DEFAULT_SCHEMES`), plus ``lci@baseline`` (lci built in the
    directory ``baseline``) if given; 5 rounds, or 1 with ``quick``."""
    return make_run_config(
        with_baseline_build(
            [Configuration.of_scheme(s) for s in dict.fromkeys(schemes or DEFAULT_SCHEMES)],
            baseline),
        quick=quick,
        rounds=rounds or (1 if quick else 5),
        only=only,
    )


def run(config: RunConfig, progress: Progress = SILENT) -> Report:
    """Every scheme once per round, rounds alternating (see the harness)."""
    return _run(config, progress, title="comm")


def ratio_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, baseline)`` of every ratio column: each label against tcp
    (if tcp takes part), then lci against lci@baseline and against ucxx (if
    both of a pair do)."""
    pairs = [(label, BASELINE) for label in labels if BASELINE in labels and label != BASELINE]
    pairs.extend(pair for pair in _EXTRA_PAIRS if set(pair) <= set(labels))
    return pairs


def format_table(report: Report) -> str:
    """The summary table (medians) plus footnotes explaining how to read it."""
    lines = medians_table(
        report, ("benchmark", "metric [unit]"), lambda bench, metric: unit_label(metric),
        lambda bench, metric, label, baseline: report.ratio(bench, metric, label, baseline),
        ratio_pairs(report.config.labels),
    )
    return "\n".join([*lines, "", *_footnotes(report)])


def _footnotes(report: Report) -> list[str]:
    config = report.config
    explanations = [
        "Ratios: <x>/<y> of the medians, >1 means <x> is better "
        "(for lower-is-better metrics the ratio is <y>/<x>).",
        "flood-<size>-x<n>: n comms of one client process write at once; nchains-<n>: n comms "
        "doing round trips at once, 'each comm' is the round-trip time one of them saw.",
    ] if ratio_pairs(config.labels) else []
    explanations.extend(idle_footnote(bench.spec, BASELINE) for bench in config.benchmarks
                        if bench.spec.kind == IDLE_KIND)
    return common_footnotes(report, explanations)


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


def to_json(report: Report) -> dict[str, Any]:
    """Raw and summarised numbers with the table's ratios."""
    return _to_json(report, ratio_pairs(report.config.labels))
