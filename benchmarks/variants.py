"""Ablation of the lci:// backend: the default configuration with one knob
switched at a time, as in the LCI paper's design-choice study.

Each variant is just another :class:`~benchmarks._configurations.Configuration`:
scheme ``lci`` plus ``distributed.comm.lci.<knob>`` set with
``dask.config.set`` in both peers (not as ``DASK_*`` variables, see
:func:`benchmarks._procs._with_dask_config`).  The default ``lci`` and ``tcp``
take part in the very same run,
with rounds alternating among all of them, so every ratio compares numbers
taken under the same machine state.

A variant the backend rejects at start-up (a provider it does not ship yet)
is reported as unavailable in its row, one whose provider needs an extra
that is missing (ucx: ``ucxx``) as not installed; the others run
regardless.  A ``providers`` variant is pinned to its first provider: its
peers fail rather than measure lci's fallback to tcp.

Budget: with 14 configurations a round is long, so the variants measure the
paper's headline numbers only (:data:`BENCHMARKS`: round trip, flood and
nchains, plus 1 and 64 MiB bandwidth for the knobs that move bulk data), with
timed windows :data:`DURATION_SCALE` times those of ``comm``, over 5 rounds:
about 8 minutes on 2 cores (~2.5 s of each configuration's round is process
start-up).  ``--quick`` runs a single round of ``comm``'s quick budgets: a
smoke test whose ratios mean nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks import _comm_suite, _format, _harness, _tables
from benchmarks._configurations import Configuration
from benchmarks._harness import Benchmark, Report, RunConfig
from benchmarks._idle import IDLE_KIND
from benchmarks._progress import SILENT, Progress
from benchmarks._tables import idle_footnote

__all__ = ["VARIANTS", "VARIANT_NAMES", "BENCHMARKS", "make_config", "run", "format_table",
           "to_json"]

#: The configuration every variant is compared with: lci as shipped.
DEFAULT = Configuration.of_scheme("lci")

#: The reference point the paper compares against, in the same run.
TCP = Configuration.of_scheme("tcp")

#: Timed windows relative to ``comm``'s full budgets (see the module docstring).
DURATION_SCALE = 0.5

#: Rounds when ``--rounds`` is not given, as ``(quick, full)``: on a noisy
#: machine a median over more short rounds beats one over fewer long ones.
DEFAULT_ROUNDS = (1, 5)

#: What every variant is measured on by default (the paper's table: round
#: trip, flood, nchains; bandwidth for the knobs that move bulk data).
BENCHMARKS = ("pingpong-8B", "flood-8B-x1", "flood-8B-x16", "nchains-64", "pingpong-1MiB",
              "pingpong-64MiB")


#: Where the lci:// knobs live in Dask's configuration.
LCI_CONFIG = "distributed.comm.lci"


@dataclass(frozen=True)
class Variant:
    """The default lci configuration with ``knobs`` (keys under
    :data:`LCI_CONFIG`, typed values as YAML would give them) switched;
    ``requires`` is the module of the extra it needs (see
    :class:`~benchmarks._configurations.Configuration`)."""

    name: str
    knobs: tuple[tuple[str, Any], ...]
    requires: str | None = None

    @classmethod
    def of(cls, name: str, knobs: Mapping[str, Any], requires: str | None = None) -> Variant:
        return cls(name, tuple(knobs.items()), requires)

    @property
    def dask_config(self) -> dict[str, Any]:
        """The knobs as dotted keys for :func:`dask.config.set`."""
        return {f"{LCI_CONFIG}.{key}": value for key, value in self.knobs}

    @property
    def provider(self) -> str | None:
        """The provider a ``providers`` variant measures: its first, the one
        lci prefers, which on one host reaches every peer -- so any other
        would be a fallback."""
        providers = dict(self.knobs).get("providers")
        return providers[0] if providers else None

    def configuration(self, label: str | None = None) -> Configuration:
        """The variant as a contender, under its own name or ``label``."""
        return Configuration(label or self.name, DEFAULT.scheme, tuple(self.dask_config.items()),
                             provider=self.provider, requires=self.requires)


def _yaml(value: Any) -> str:
    """``False`` -> ``false``, ``["shm", "tcp"]`` -> ``[shm, tcp]``: as YAML spells them."""
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_yaml, value))}]"
    return str(value).lower() if isinstance(value, bool) else str(value)


VARIANTS = (
    Variant.of("thread", {"progress": "thread"}),
    Variant.of("thread-2", {"progress": "thread", "progress-threads": 2}),
    Variant.of("sync", {"completion": "sync"}),
    Variant.of("ndevices-2", {"ndevices": 2}),
    Variant.of("ndevices-4", {"ndevices": 4}),
    Variant.of("aggregation", {"aggregation": True}),
    Variant.of("eager-0", {"eager-threshold": 0}),
    Variant.of("eager-1MiB", {"eager-threshold": "1MiB"}),
    Variant.of("fragment-256KiB", {"fragment-size": "256KiB"}),
    Variant.of("fragment-4MiB", {"fragment-size": "4MiB"}),
    # How long a shm receiver keeps polling after traffic instead of
    # sleeping (the shipped default is 0: no polling).
    Variant.of("poll-100us", {"shm.poll-window": "100us"}),
    Variant.of("poll-500us", {"shm.poll-window": "500us"}),
    Variant.of("poll-2ms", {"shm.poll-window": "2ms"}),
    # Large shm frames without the pool: read from the sender's memory, or
    # (rendezvous-bytes 0) copied through the ring.
    Variant.of("shm-reads", {"shm.pool-size": 0}),
    Variant.of("shm-ring", {"shm.pool-size": 0, "shm.rendezvous-bytes": 0}),
    # Shared memory against tcp alone on one host (tcp always carries the
    # greeting); one of the two restates the shipped default.  UCX needs the
    # ucx extra (ucxx).
    Variant.of("providers-tcp", {"providers": ["tcp"]}),
    Variant.of("providers-shm", {"providers": ["shm", "tcp"]}),
    Variant.of("providers-ucx", {"providers": ["ucx", "tcp"]}, requires="ucxx"),
    # libfabric's tcp provider on loopback: the fabric every host has (the
    # extension is built where libfabric's headers are found).
    Variant.of("providers-ofi", {"providers": ["ofi", "tcp"], "ofi.provider": "tcp;ofi_rxm",
                                 "ofi.node": "127.0.0.1"}, requires="dask_lcicomm.providers._ofi"),
    # The same with every bulk group sent, none read by RMA.
    Variant.of("providers-ofi-sends", {"providers": ["ofi", "tcp"], "ofi.provider": "tcp;ofi_rxm",
                                       "ofi.node": "127.0.0.1", "ofi.rendezvous-bytes": 0},
               requires="dask_lcicomm.providers._ofi"),
)

VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}

VARIANT_NAMES = tuple(VARIANTS_BY_NAME)


def select_variants(names: Iterable[str] | None) -> list[Variant]:
    """The named variants in their canonical order (all if ``names`` is None)."""
    wanted = set(names) if names else set(VARIANT_NAMES)
    unknown = wanted - set(VARIANT_NAMES)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANT_NAMES}")
    return [v for v in VARIANTS if v.name in wanted]


def make_config(
    names: Iterable[str] | None = None,
    quick: bool = False,
    rounds: int | None = None,
    only: Iterable[str] | None = None,
) -> RunConfig:
    """Default lci, tcp and the selected variants; by default
    :data:`BENCHMARKS` (any comm benchmark can be asked for, ``idle`` at
    ~15 s per configuration)."""
    variants = select_variants(names)
    return _comm_suite.make_run_config(
        [DEFAULT, TCP, *(v.configuration() for v in variants)],
        quick=quick,
        rounds=rounds or DEFAULT_ROUNDS[not quick],
        only=only,
        default_benchmarks=BENCHMARKS,
        duration_scale=1.0 if quick else DURATION_SCALE,
    )


def run(config: RunConfig, progress: Progress = SILENT) -> Report:
    """Every configuration once per round, rounds alternating (see the harness)."""
    return _harness.run(config, _comm_suite.run_comm_round, progress, title="variants")


# ------------------------------------------------------------------ reporting


def _settings(config: RunConfig) -> dict[str, str]:
    """What each row changed relative to the default, by label."""
    prefix = f"{LCI_CONFIG}."
    return {
        c.label: " ".join(f"{key.removeprefix(prefix)}={_yaml(value)}"
                          for key, value in c.dask_config)
        or f"{c.scheme}:// instead of {DEFAULT.scheme}://"
        for c in config.configurations
        if c.label != DEFAULT.label
    }


def format_table(report: Report) -> str:
    """One row per variant (and tcp), one column per benchmark headline
    metric; cells are ratios to the default lci, whose absolute medians form
    the first row."""
    config = report.config
    benches = config.benchmarks
    header = ["variant", "setting", *(b.spec.name for b in benches)]
    units = ["", "", *(b.metrics[0].unit for b in benches)]
    absolute = [f"{DEFAULT.label} (default)", "absolute medians",
                *(_absolute_cell(report, b) for b in benches)]
    spread = [f"{DEFAULT.label} (default)", "spread: max/min of its rounds",
              *(_spread_cell(report, b) for b in benches)]
    rows = [
        [label, setting, *(_ratio_cell(report, b, label) for b in benches)]
        for label, setting in _settings(config).items()
    ]
    table = _format.align([header, units, absolute, spread, *rows], label_columns=2,
                           rules=(2, 4))
    return "\n".join([*table, "", *_footnotes(report)])


def _absolute_cell(report: Report, bench: Benchmark) -> str:
    """The default lci's median of the benchmark's headline metric."""
    return _tables.median_cell(report, bench, bench.metrics[0], DEFAULT.label)


def _spread_cell(report: Report, bench: Benchmark) -> str:
    """How far apart the default lci's own rounds lie: ratios closer to 1
    than this are within the noise of the machine."""
    values = [v for v in report.values(bench, bench.metrics[0], DEFAULT.label) if v]
    return _format.format_ratio(max(values) / min(values) if len(values) > 1 else None)


def _ratio_cell(report: Report, bench: Benchmark, label: str) -> str:
    """``label`` against the default lci on the benchmark's headline metric,
    or why ``label`` did not run."""
    status = report.status[label]
    if not status.available:
        return status.label
    ratio = report.ratio(bench, bench.metrics[0], label, DEFAULT.label)
    return _format.format_ratio(ratio)


def _footnotes(report: Report) -> list[str]:
    config = report.config
    explanations = [
        f"Cells: <row>/{DEFAULT.label} of the medians of each benchmark's headline metric "
        f"(units in the second line), >1 means the row is better than the default "
        f"{DEFAULT.label}; '-' means no number on one side.  The spread line shows how "
        f"much the default alone varies between rounds: read ratios within it as noise.",
        f"Variants: {DEFAULT.label} with {LCI_CONFIG}.<knob> set (dask.config.set) in both "
        f"peer processes; every other knob at the harness's own setting "
        f"({_inherited(report) or 'the shipped defaults'}).",
        "--quick: tiny budgets; a smoke test, the ratios mean nothing." if config.quick
        else f"Budget: timed windows {DURATION_SCALE:g}x those of 'comm', so that default lci, "
        f"tcp and all {len(VARIANTS)} variants fit in ~8 minutes.",
    ]
    explanations.extend(idle_footnote(b.spec, DEFAULT.label) for b in config.benchmarks
                        if b.spec.kind == IDLE_KIND)
    return _tables.common_footnotes(report, explanations)


def _inherited(report: Report) -> str:
    inherited = report.environment.get("inherited_lci_env", {})
    return " ".join(f"{key}={value}" for key, value in inherited.items())


def to_json(report: Report) -> dict[str, Any]:
    """Raw and summarised numbers, ratios against the default lci, and what
    each variant switched."""
    data = _harness.to_json(report, [(label, DEFAULT.label) for label in report.config.labels
                                     if label != DEFAULT.label])
    data["config"]["variants"] = {v.name: v.dask_config for v in VARIANTS
                                  if v.name in report.config.labels}
    return data

