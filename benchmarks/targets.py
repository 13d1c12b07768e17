"""The ratios lci:// is judged on, checked against a run's own numbers.

Each :class:`Target` names one benchmark of one command, the two
configurations it compares and the bound the ratio must meet.  Evaluating it
on a :class:`~benchmarks._harness.Report` gives the measured ratio and
whether the bound is met -- or why there is no ratio (a scheme not installed,
a failed benchmark) -- so a missed target is printed next to the tables
instead of being left for a reader to work out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks._harness import Benchmark, Metric, Report, align, format_ratio

__all__ = ["TARGETS", "Target", "Verdict", "evaluate", "format_verdicts", "verdicts_json"]


@dataclass(frozen=True)
class Target:
    """``label`` against ``baseline`` on ``metric`` of ``benchmark`` in
    ``command``'s run.

    ``speedup`` ratios are oriented so that >1 means ``label`` is better and
    the bound is a minimum; otherwise the ratio is the plain quotient of the
    medians (times: <1 means ``label`` is faster) and the bound a maximum.
    """

    command: str
    benchmark: str
    metric: str
    label: str
    baseline: str
    bound: float
    speedup: bool

    @property
    def wanted(self) -> str:
        op = ">=" if self.speedup else "<="
        return f"{self.label}/{self.baseline} {self.metric} {op} {self.bound:g}"

    def ratio(self, report: Report, bench: Benchmark, metric: Metric) -> float | None:
        if self.speedup:
            return report.ratio(bench, metric, self.label, self.baseline)
        return report.quotient(bench, metric, self.label, self.baseline)

    def met_by(self, ratio: float) -> bool:
        return ratio >= self.bound if self.speedup else ratio <= self.bound


def _time_target(graph: str, bound: float) -> Target:
    return Target("dask", graph, "time", "lci", "tcp", bound, speedup=False)


def _ucxx_target(benchmark: str, metric: str) -> Target:
    return Target("comm", benchmark, metric, "lci", "ucxx", 2.0, speedup=True)


def _ucx_provider_target(benchmark: str, metric: str) -> Target:
    """lci over its ucx provider no worse than UCX's own Dask backend: the
    same fabric, so what differs is the backend."""
    return Target("comm", benchmark, metric, "lci-ucx", "ucxx", 1.0, speedup=True)


def _tcp_target(benchmark: str, metric: str, bound: float) -> Target:
    return Target("comm", benchmark, metric, "lci", "tcp", bound, speedup=True)


def _shm_target(benchmark: str, metric: str) -> Target:
    """Shared memory on one host no worse than the tcp provider."""
    return Target("variants", benchmark, metric, "lci", "providers-tcp", 1.0, speedup=True)


TARGETS = (
    # the backend: small messages
    _tcp_target("pingpong-8B", "latency", 2.0),
    _tcp_target("flood-8B-x1", "rate", 2.5),
    _tcp_target("nchains-64", "rate", 2.0),
    # shared memory on one host (the default there)
    _tcp_target("pingpong-64MiB", "bandwidth", 3.0),
    _tcp_target("pingpong-1MiB", "bandwidth", 2.0),
    _tcp_target("flood-16KiB-x1", "rate", 2.0),
    _shm_target("pingpong-8B", "latency"),
    _shm_target("flood-8B-x1", "rate"),
    # Dask graphs
    _time_target("move", 0.5),
    _time_target("gather", 0.4),
    _time_target("rechunk-tasks", 0.8),
    _time_target("rechunk-p2p", 0.8),
    *(_time_target(graph, 1.05) for graph in ("array", "shuffle", "tree", "amt")),
    *(_ucxx_target(f"pingpong-{size}", "latency") for size in ("8B", "64B", "1KiB")),
    _ucxx_target("pingpong-1MiB", "bandwidth"),
    # lci over UCX (the fabric between hosts where there is one)
    _ucx_provider_target("pingpong-8B", "latency"),
    _ucx_provider_target("pingpong-1MiB", "bandwidth"),
    _ucx_provider_target("pingpong-64MiB", "bandwidth"),
    # an idle cluster on UCX must not poll
    Target("comm", "idle", "cpu", "lci-ucx", "tcp", 1.2, speedup=False),
)


@dataclass(frozen=True)
class Verdict:
    """A target on one run: its ratio and whether it was met, or why not measured."""

    target: Target
    ratio: float | None
    met: bool | None
    why_not: str = ""

    @property
    def outcome(self) -> str:
        if self.met is None:
            return f"not measured: {self.why_not}"
        return "met" if self.met else "MISSED"


def evaluate(command: str, report: Report) -> list[Verdict]:
    """The verdicts of ``command``'s targets whose benchmark took part in ``report``."""
    benches = {b.spec.name: b for b in report.config.benchmarks}
    return [_verdict(t, report, benches[t.benchmark]) for t in TARGETS
            if t.command == command and t.benchmark in benches]


def _verdict(target: Target, report: Report, bench: Benchmark) -> Verdict:
    for label in (target.label, target.baseline):
        status = report.status.get(label)
        if status is None:
            return Verdict(target, None, None, f"{label} not in the run")
        if not status.available:
            return Verdict(target, None, None, f"{label} {status.label}")
    metric = next(m for m in bench.metrics if m.key == target.metric)
    ratio = target.ratio(report, bench, metric)
    if ratio is None:
        return Verdict(target, None, None, "a configuration has no successful round")
    return Verdict(target, ratio, target.met_by(ratio))


def format_verdicts(verdicts: list[Verdict]) -> str:
    """A table of targets: what is wanted, what was measured, met or not."""
    rows = [["command", "benchmark", "target", "verdict", "measured"]]
    rows.extend(
        [v.target.command, v.target.benchmark, v.target.wanted, v.outcome, format_ratio(v.ratio)]
        for v in verdicts
    )
    return "\n".join(align(rows, label_columns=4))


def verdicts_json(verdicts: list[Verdict]) -> list[Mapping[str, Any]]:
    return [
        {
            "command": v.target.command,
            "benchmark": v.target.benchmark,
            "wanted": v.target.wanted,
            "ratio": v.ratio,
            "met": v.met,
            "why_not": v.why_not,
        }
        for v in verdicts
    ]
