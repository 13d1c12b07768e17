"""Side-by-side benchmarks of Dask comm backends (``lci``, ``tcp``, ``ucxx``).

The special case of :mod:`benchmarks._harness` where every configuration is a
plain scheme, with whatever environment the harness itself was started in.
The table has one row per benchmark metric and one column per scheme, plus
``<scheme>/tcp`` ratio columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from benchmarks._comm_peers import BenchSpec
from benchmarks._harness import (
    BENCHMARK_NAMES,
    IDLE_PER_S,
    Configuration,
    Report,
    RunConfig,
    common_footnotes,
    make_run_config,
    medians_table,
    run,
    unit_label,
)
from benchmarks._harness import to_json as _to_json
from benchmarks._idle import IDLE_KIND, N_WORKERS

__all__ = ["BENCHMARK_NAMES", "BASELINE", "make_config", "run", "format_table", "to_json"]

#: The scheme that ratio columns divide by.
BASELINE = "tcp"


def make_config(
    schemes: Sequence[str],
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
) -> RunConfig:
    """One configuration per scheme (de-duplicated, order kept); 5 rounds,
    or 2 with ``quick``."""
    return make_run_config(
        [Configuration.of_scheme(s) for s in dict.fromkeys(schemes)],
        quick=quick,
        rounds=rounds or (2 if quick else 5),
        only=only,
    )


def ratio_schemes(config: RunConfig) -> list[str]:
    """Schemes that get a ``<scheme>/tcp`` column (needs tcp in the run)."""
    if BASELINE not in config.labels:
        return []
    return [s for s in config.labels if s != BASELINE]


def format_table(report: Report) -> str:
    """The summary table (medians) plus footnotes explaining how to read it."""
    lines = medians_table(
        report, ("benchmark", "metric [unit]"), lambda bench, metric: unit_label(metric),
        partial(report.ratio, baseline=BASELINE), ratio_schemes(report.config), BASELINE,
    )
    return "\n".join([*lines, "", *_footnotes(report)])


def _footnotes(report: Report) -> list[str]:
    config = report.config
    explanations = [
        f"Ratios: <scheme>/{BASELINE} of the medians, >1 means <scheme> is better "
        f"(for lower-is-better metrics the ratio is {BASELINE}/<scheme>)."
    ] if ratio_schemes(config) else []
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
    """Raw and summarised numbers, ratios against tcp if it took part."""
    return _to_json(report, BASELINE if BASELINE in report.config.labels else None)
