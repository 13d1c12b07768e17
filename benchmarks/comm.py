"""Side-by-side benchmarks of Dask comm backends (``lci``, ``tcp``, ``ucxx``),
and of lci over each of its providers: the LCI paper's microbenchmarks on
Dask's Comm API.

* ping-pong sweep, 8 B .. 64 MiB: latency where small, bandwidth where large;
* flood: message rate of one-way writes, 8 B and 16 KiB, 1, 4 and 16
  concurrent senders (comms);
* nchains: 1 .. 1024 comms doing round trips at once: latency under load;
* idle: the CPU time an idle ``LocalCluster`` burns.

The special case of :mod:`benchmarks._harness` where the configurations are
plain schemes, with whatever environment the harness itself was started in,
and lci pinned to one provider (:data:`PINNED`: ``lci-tcp``, the path between
hosts, ``lci-ucx``, UCX, and ``lci-ofi``, libfabric -- the ``providers`` variants of
:mod:`benchmarks.variants` under these labels; plain ``lci`` runs the default
providers, shared memory on one host) -- plus, with ``baseline``, lci as
built in another directory (``lci@baseline``, see
:func:`benchmarks._configurations.baseline_build`).  The table has one row per
benchmark metric and one column per configuration, plus ``<label>/tcp``
ratio columns, ``lci/lci@baseline``, ``lci/ucxx``, ``lci-ucx/ucxx``,
``lci-ofi/ucxx`` and ``lci-ofi/lci-ucx`` when both take part.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks._comm_suite import BENCHMARK_NAMES, make_run_config, run_comm_round
from benchmarks._configurations import BASELINE_BUILD, Configuration, with_baseline_build
from benchmarks._harness import Report, RunConfig
from benchmarks._harness import run as _run
from benchmarks._harness import to_json as _to_json
from benchmarks._idle import IDLE_KIND
from benchmarks._progress import SILENT, Progress
from benchmarks._tables import common_footnotes, idle_footnote, medians_table, unit_label
from benchmarks.variants import VARIANTS_BY_NAME

__all__ = ["BENCHMARK_NAMES", "BASELINE", "DEFAULT_SCHEMES", "DEFAULT_NAMES", "PINNED",
           "make_config", "run", "format_table", "to_json", "ratio_pairs"]

#: The scheme that ratio columns divide by.
BASELINE = "tcp"

#: The plain schemes, as ``dask`` runs them too: ucxx shows as "not
#: installed" where the ``ucx`` extra is missing.
DEFAULT_SCHEMES = ("lci", "tcp", "ucxx")

#: lci pinned to one provider, by label: its peers fail rather than measure
#: a fallback to tcp, and lci-ucx shows as "not installed" without ucxx.
LCI_TCP = VARIANTS_BY_NAME["providers-tcp"].configuration("lci-tcp")
LCI_UCX = VARIANTS_BY_NAME["providers-ucx"].configuration("lci-ucx")
LCI_OFI = VARIANTS_BY_NAME["providers-ofi"].configuration("lci-ofi")
PINNED = {c.label: c for c in (LCI_TCP, LCI_UCX, LCI_OFI)}

#: What runs when no names are given: each lci next to its plain ``lci``.
DEFAULT_NAMES = ("lci", *PINNED, "tcp", "ucxx")

#: Ratio columns beyond ``<x>/tcp``: this build against an earlier one, and
#: the comparisons the project is judged on (UCX's own against lci's).
_EXTRA_PAIRS = (("lci", BASELINE_BUILD), ("lci", "ucxx"), (LCI_UCX.label, "ucxx"),
                (LCI_OFI.label, "ucxx"), (LCI_OFI.label, LCI_UCX.label))


def make_config(
    names: Sequence[str] | None = None,
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> RunConfig:
    """One configuration per name (de-duplicated, order kept; default
    :data:`DEFAULT_NAMES`): a label of :data:`PINNED`, else a scheme; plus
    ``lci@baseline`` (lci built in the directory ``baseline``) if given;
    5 rounds, or 1 with ``quick``."""
    return make_run_config(
        with_baseline_build(
            [PINNED.get(name) or Configuration.of_scheme(name)
             for name in dict.fromkeys(names or DEFAULT_NAMES)],
            baseline),
        quick=quick,
        rounds=rounds or (1 if quick else 5),
        only=only,
    )


def run(config: RunConfig, progress: Progress = SILENT) -> Report:
    """Every scheme once per round, rounds alternating (see the harness)."""
    return _run(config, run_comm_round, progress, title="comm")


def ratio_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, baseline)`` of every ratio column: each label against tcp
    (if tcp takes part), then lci against lci@baseline and against ucxx, and
    lci-ucx against ucxx (if both of a pair do)."""
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
    pinned = [c for c in config.configurations if c.label in PINNED]
    if pinned:
        explanations.append(
            f"{', '.join(f'{c.label} (lci over {c.provider})' for c in pinned)}: lci with "
            f"distributed.comm.lci.providers starting with that provider; every comm and every "
            f"link of the idle cluster is checked to run over it, and fails otherwise (lci "
            f"would fall back to tcp). Plain lci: the default providers (shared memory on one "
            f"host).")
    explanations.extend(idle_footnote(bench.spec, BASELINE) for bench in config.benchmarks
                        if bench.spec.kind == IDLE_KIND)
    return common_footnotes(report, explanations)


def to_json(report: Report) -> dict[str, Any]:
    """Raw and summarised numbers with the table's ratios."""
    return _to_json(report, ratio_pairs(report.config.labels))
