"""The summary tables of a :class:`~benchmarks._harness.Report` and the
footnotes that say how its numbers were taken."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from benchmarks._comm_peers import BenchSpec
from benchmarks._comm_suite import IDLE_PER_S, family
from benchmarks._environment import PACKAGE
from benchmarks._format import align, format_number, format_ratio
from benchmarks._harness import Benchmark, Metric, Report
from benchmarks._idle import N_WORKERS


def median_cell(report: Report, bench: Benchmark, metric: Metric, label: str) -> str:
    """An absolute median, or why there is none."""
    status = report.status[label]
    if not status.available:
        return status.label
    median = report.median(bench, metric, label)
    return "error" if median is None else format_number(median)


def unit_label(metric: Metric) -> str:
    return metric.unit if metric.higher_is_better else f"{metric.unit} (lower=better)"


def medians_table(
    report: Report,
    header: tuple[str, str],
    describe: Callable[[Benchmark, Metric], str],
    ratio: Callable[[Benchmark, Metric, str, str], float | None],
    ratio_pairs: Sequence[tuple[str, str]],
    unit: str = "",
    group: Callable[[Benchmark], str] = lambda bench: family(bench.spec.name),
) -> list[str]:
    """The lines of a summary table: one row per benchmark metric with its
    name and ``describe(bench, metric)`` (headed by ``header``), the median
    of every configuration (headed by its label and ``unit``), then a
    ``<label>/<baseline>`` column per pair of ``ratio_pairs``, filled by
    ``ratio(bench, metric, label, baseline)``; a rule wherever ``group``
    changes (default: between benchmark families)."""
    labels = report.config.labels
    head = [*header, *(f"{label}{unit}" for label in labels),
            *(f"{label}/{baseline}" for label, baseline in ratio_pairs)]
    rows: list[list[str]] = []
    rules = [1]
    previous: str | None = None
    for bench in report.config.benchmarks:
        if previous is not None and group(bench) != previous:
            rules.append(len(rows) + 1)
        previous = group(bench)
        rows.extend(
            [
                bench.spec.name,
                describe(bench, metric),
                *(median_cell(report, bench, metric, label) for label in labels),
                *(format_ratio(ratio(bench, metric, label, baseline))
                  for label, baseline in ratio_pairs),
            ]
            for metric in bench.metrics
        )
    return align([head, *rows], label_columns=2, rules=rules)


def common_footnotes(report: Report, explanations: Sequence[str] = ()) -> list[str]:
    """How the numbers were taken, the table's own ``explanations``, and
    everything that went wrong (last, where a reader looks for it)."""
    config = report.config
    notes = [
        f"Values: median over {config.rounds} round(s) per configuration (even count: the "
        f"worse middle value); rounds alternate configurations "
        f"({', '.join(config.labels)}; order rotated each round); server and client each "
        f"in their own process on 127.0.0.1.",
        "Units: higher is better unless marked; MiB/s counts both directions "
        "(2 * payload * round trips / s); pingpong payloads are random bytes.",
        *explanations,
        *build_notes(report),
        machine_note(report),
    ]
    return notes + problem_notes(report)


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


def build_notes(report: Report) -> list[str]:
    """Which build of :data:`PACKAGE` each configuration with a
    ``pythonpath`` ran, as a child of it reported (see
    :func:`probe_configurations`)."""
    return [
        f"{c.label}: {report.status[c.label].detail}, in every process of it (peers; "
        f"clusters and their workers); the other configurations: {PACKAGE} from "
        f"{report.environment.get(PACKAGE, 'unknown')}."
        for c in report.config.configurations
        if c.pythonpath and report.status[c.label].available
    ]


def machine_note(report: Report) -> str:
    """Where and what was measured, in one line."""
    env = report.environment
    settings = env["lci_settings"]
    providers = ", ".join(settings["providers"]) if isinstance(settings, dict) else settings
    return (f"Measured: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']:g} GiB, "
            f"load average {env['load_average'][0]:g} at the start (other work on the machine "
            f"adds noise), Python {env['python']}, distributed {env['distributed']}; "
            f"code {env['source']}, lci providers [{providers}].")


def problem_notes(report: Report) -> list[str]:
    """Configurations that could not run, and every failed round."""
    notes = [
        f"{label}: {status.label}: {status.detail}"
        for label, status in report.status.items()
        if not status.available
    ]
    for failure in report.failures():
        where = f"{failure.configuration} {failure.benchmark} round {failure.round + 1}"
        notes.append(f"{where} failed: {failure.error}")
    return notes
