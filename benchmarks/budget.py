"""Where one small-message round trip spends its time, per category:
``python -m benchmarks budget``.

The comm benchmark says how long a round trip takes; this says what it is made
of.  For each payload (8 B, 1 KiB, 16 KiB, in the ping-pong's message shape)
and each configuration (lci over shared memory, lci over its tcp, ucx and ofi providers,
Dask's tcp, ucxx when installed, and ``floor://``: Dask's serialization over
bare asyncio streams, the least a Dask comm does, see
:mod:`benchmarks._floor_comm`), the ping-pong's client and server run in
their own processes while py-spy samples both of them (see
:mod:`benchmarks._budget_measure`) and their CPU times are read from
``/proc``.  Per process and round trip of the same loop, the kernel time is
the syscalls (doorbells included), the user time is shared among the
user-space categories by their samples (every sample classified by its
stack: :data:`benchmarks._budget_rules.RULES`), and the rest of the round trip
is waiting; over the pair, what neither process spends on CPU is the wait
(wake-up latency, net of the time both run at once).  py-spy alone puts far
less time on CPU than ``/proc`` for processes that keep sleeping and waking,
so samples only apportion; what they alone say is kept as a cross-check, as
is ``to_frames`` and ``from_frames`` of the very message timed in this
process (each paid once per side per round trip).

Rounds alternate configurations as in the other commands, and a cell pools
the samples and round trips of all its rounds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks._budget_measure import (
    ROLES,
    Budgets,
    RoundResult,
    measure_round,
    serialization_us,
)
from benchmarks._budget_rules import (
    CATEGORIES,
    IN_USER,
    ON_CPU,
    RULES,
    SYSCALLS,
    TORN,
    WAIT,
)
from benchmarks._comm_suite import KiB, size_name
from benchmarks._configurations import Configuration, SchemeStatus, probe_configurations
from benchmarks._environment import environment_facts
from benchmarks._floor_comm import SCHEME as FLOOR
from benchmarks._format import align, format_number
from benchmarks._harness import rotated
from benchmarks._progress import SILENT, Progress
from benchmarks.comm import LCI_OFI, LCI_TCP, LCI_UCX
from benchmarks.variants import VARIANTS_BY_NAME

__all__ = ["CONFIGURATIONS", "SIZES", "make_config", "run", "format_table", "to_json"]

#: The payloads: a tiny task message, a small object, a small array chunk.
SIZES = (8, KiB, 16 * KiB)

#: What is compared; ucxx shows as not installed where it is not.
CONFIGURATIONS = (
    Configuration("lci-shm", "lci"),  # shared memory: the default on one host
    VARIANTS_BY_NAME["poll-500us"].configuration("lci-shm-poll"),
    VARIANTS_BY_NAME["thread"].configuration("lci-shm-thread"),
    LCI_TCP,
    LCI_UCX,
    LCI_OFI,
    Configuration.of_scheme("tcp"),
    Configuration.of_scheme("ucxx"),
    # The least a Dask comm does here: Dask's serialization over asyncio streams.
    Configuration.of_scheme(FLOOR),
)

#: Budgets as ``(quick, full)``: windows, sampling rate, rounds, and the
#: serialization cross-check's iterations and seconds.  Full: ~2 minutes on
#: 2 cores for the four lci configurations and tcp; quick: ~30 s.
_BUDGETS = (Budgets(reference_s=0.3, window_s=1.0, rate_hz=200, warmup=20),
            Budgets(reference_s=1.0, window_s=4.0, rate_hz=250, warmup=100))
_ROUNDS = (1, 2)
_SERIALIZATION = ((200, 0.2), (5000, 1.0))


@dataclass(frozen=True)
class BudgetConfig:
    """Everything that defines a run; recorded in the JSON."""

    configurations: tuple[Configuration, ...]
    sizes: tuple[int, ...]
    rounds: int
    quick: bool
    budgets: Budgets

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.configurations)


def make_config(names: Iterable[str] | None = None, quick: bool = False,
                rounds: int | None = None, only: Iterable[str] | None = None) -> BudgetConfig:
    """The named configurations (default: all of :data:`CONFIGURATIONS`) and
    payloads (``only``, by size name, default all of :data:`SIZES`);
    :class:`ValueError` for unknown names."""
    known = {c.label: c for c in CONFIGURATIONS}
    sizes = {size_name(s): s for s in SIZES}
    wanted, wanted_sizes = list(names or known), list(only or sizes)
    unknown = [n for n in wanted if n not in known] + [s for s in wanted_sizes if s not in sizes]
    if unknown:
        raise ValueError(f"unknown {unknown}; configurations: {tuple(known)}, "
                         f"sizes: {tuple(sizes)}")
    if rounds is not None and rounds < 1:
        raise ValueError("rounds must be >= 1")
    return BudgetConfig(tuple(known[n] for n in dict.fromkeys(wanted)),
                        tuple(sizes[s] for s in dict.fromkeys(wanted_sizes)),
                        rounds or _ROUNDS[not quick], quick, _BUDGETS[not quick])


# ------------------------------------------------------------------ running


@dataclass
class BudgetReport:
    """A run's raw material: what could run, the in-process serialization
    costs, every round's result, and the machine (its load at start and end)."""

    config: BudgetConfig
    status: dict[str, SchemeStatus]
    serialization: dict[int, tuple[float, float]]  # size -> (to_frames, from_frames) µs
    results: list[RoundResult] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def failures(self) -> list[RoundResult]:
        return [r for r in self.results if r.error is not None]


def run(config: BudgetConfig, progress: Progress = SILENT) -> BudgetReport:
    """The serialization cross-check, then every available configuration
    once per round (rounds alternate, the order rotating)."""
    environment = environment_facts()
    status = probe_configurations(config.configurations)
    runnable = [c for c in config.configurations if status[c.label].available]
    progress.start("budget", len(config.sizes) * (1 + config.rounds * len(runnable)))
    for label, why in status.items():
        if not why.available:
            progress.note(f"{label}: {why.label} ({why.detail})")
    count, seconds = _SERIALIZATION[not config.quick]
    serialization = {}
    for size in config.sizes:
        serialization[size] = serialization_us(size, count, seconds)
        to_us, from_us = serialization[size]
        progress.step(f"{size_name(size)}: to_frames {to_us:.1f} us, from_frames {from_us:.1f} us")
    report = BudgetReport(config, status, serialization, environment=environment)

    def record(result: RoundResult) -> None:
        report.results.append(result)
        progress.step(_progress_line(config, result))

    for round_index in range(config.rounds):
        for configuration in rotated(runnable, round_index):
            measure_round(configuration, config.sizes, config.budgets, round_index, record)
    environment["load_average_end"] = [round(load, 2) for load in os.getloadavg()]
    return report


def _progress_line(config: BudgetConfig, result: RoundResult) -> str:
    head = (f"[round {result.round + 1}/{config.rounds}] {result.label:<8} "
            f"{size_name(result.size):<6}")
    if result.loop is None:
        return f"{head} FAILED: {result.error}"
    profiled = result.loop.profiled
    samples = result.recording.samples
    seen = (", ".join(f"{role} {sum(samples[role].values())}" for role in samples)
            or f"no profile: {result.recording.error}")
    return f"{head} {profiled.seconds / profiled.count * 1e6:.0f} us/round trip; samples: {seen}"


# ---------------------------------------------------------------- the budget


@dataclass(frozen=True)
class Cell:
    """One payload and configuration, pooled over its rounds.

    ``rt_us`` is the round trip of the profiled loop and ``reference_us``
    that of the unprofiled window.  ``user_us`` and ``system_us`` are each
    role's CPU time per round trip in user space and in the kernel
    (``/proc``).  ``per_role`` is each role's budget: its user time shared
    among the user-space categories by its samples, its kernel time as
    ``syscalls``, the rest of the round trip as ``wait`` (so each role adds up
    to ``rt_us``); ``pair`` adds the roles' on-CPU categories, its ``wait`` is
    what neither spends on CPU.  ``preempted`` is how often per round trip a
    role lost its CPU while it could have run (a busy machine: samples then
    see code that is not running).  ``sampled_cpu_us`` is what the samples alone
    say of each role's time on CPU (its non-wait share of the round trip):
    the cross-check.  ``samples`` counts each role's classified samples,
    ``dropped`` those py-spy could not read or read torn (left out).
    """

    rt_us: float
    reference_us: float
    provider: str | None
    user_us: dict[str, float]
    system_us: dict[str, float]
    per_role: dict[str, dict[str, float]]
    pair: dict[str, float]
    preempted: dict[str, float]
    sampled_cpu_us: dict[str, float]
    samples: dict[str, int]
    dropped: dict[str, int]


def cell(report: BudgetReport, size: int, label: str) -> Cell | None:
    """The budget of ``label`` at ``size``, or None without a measured round."""
    rounds = [r for r in report.results
              if r.size == size and r.label == label and r.loop is not None]
    if not rounds:
        return None
    rt_us = _per_trip_us(r.loop.profiled for r in rounds if r.loop)
    recordings = [r.recording for r in rounds]
    wall = sum(rec.wall_s for rec in recordings)
    trips = wall / rt_us * 1e6
    user_us = {role: sum(rec.user_s[role] for rec in recordings) / trips * 1e6 for role in ROLES}
    system_us = {role: sum(rec.system_s[role] for rec in recordings) / trips * 1e6
                 for role in ROLES}
    profiled = [rec for rec in recordings if rec.error is None]
    counts = {role: {c: sum(rec.samples[role].get(c, 0) for rec in profiled) for c in CATEGORIES}
              for role in ROLES} if profiled else {}
    per_role = {role: _split(by, user_us[role], system_us[role], rt_us)
                for role, by in counts.items()}
    pair = {c: sum(by[c] for by in per_role.values()) for c in CATEGORIES}
    return Cell(
        rt_us=rt_us,
        reference_us=_per_trip_us(r.loop.reference for r in rounds if r.loop),
        provider=rounds[0].loop.provider if rounds[0].loop else None,
        user_us=user_us,
        system_us=system_us,
        per_role=per_role,
        pair=pair | {WAIT: rt_us - sum(user_us.values()) - sum(system_us.values())}
        if per_role else {},
        preempted={role: sum(rec.preempted[role] for rec in recordings) / trips for role in ROLES},
        sampled_cpu_us={role: (1 - by[WAIT] / max(sum(by.values()), 1)) * rt_us
                        for role, by in counts.items()},
        samples={role: sum(by.values()) for role, by in counts.items()},
        dropped={role: sum(rec.dropped[role] + rec.samples[role].get(TORN, 0) for rec in profiled)
                 for role in counts},
    )


def _split(counts: dict[str, int], user_us: float, system_us: float,
           rt_us: float) -> dict[str, float]:
    """A role's µs per round trip by category: its user time shared by its
    user-space samples, its kernel time as syscalls, the rest waiting."""
    in_user = max(sum(counts[c] for c in IN_USER), 1)
    return ({c: counts[c] / in_user * user_us for c in IN_USER}
            | {SYSCALLS: system_us, WAIT: rt_us - user_us - system_us})


def _per_trip_us(measurements: Iterable[Any]) -> float:
    pooled = list(measurements)
    return sum(m.seconds for m in pooled) / sum(m.count for m in pooled) * 1e6


# ---------------------------------------------------------------- reporting

#: The categories in the order of the table and the figures: on CPU, then the wait.
ROWS = (*ON_CPU, WAIT)

#: Rows of the table, as the categories read in it.
_ROW_NAMES = {
    "serialization": "serialization (to/from_frames)",
    "event loop": "event-loop hops",
    "syscalls": "syscalls and doorbells",
    "codec": "lci codec (parcel/)",
    "lci": "lci layers (rest of dask_lcicomm)",
    "dask comm": "Dask comm layer (+ tornado streams; floor's comm)",
    "other": "other on CPU (benchmark loop)",
    WAIT: "wait: neither process on CPU",
}


def format_table(report: BudgetReport) -> str:
    """A table per payload: µs per round trip by category and configuration,
    then the round trip and the cross-checks; footnotes say how to read it."""
    blocks = [_size_table(report, size) for size in report.config.sizes]
    return "\n\n".join([*blocks, "\n".join(_footnotes(report))])


def _size_table(report: BudgetReport, size: int) -> str:
    labels = report.config.labels
    cells = {label: cell(report, size, label) for label in labels}
    to_us, from_us = report.serialization[size]

    def row(name: str, value: Any) -> list[str]:
        return [name, *(_value_cell(report, label, cells[label], value) for label in labels)]

    rows = [
        [f"{size_name(size)} payload, us per round trip", *labels],
        *(row(_ROW_NAMES[c], lambda k, c=c: k.pair.get(c)) for c in ROWS),
        row("round trip, profiled loop (= sum)", lambda k: k.rt_us),
        row("round trip, unprofiled", lambda k: k.reference_us),
        row("on CPU client/server, /proc", lambda k: _pair(k.user_us[r] + k.system_us[r]
                                                           for r in ROLES)),
        row("on CPU client/server, py-spy", lambda k: _pair(k.sampled_cpu_us.values())
            if k.sampled_cpu_us else None),
        row("preempted per round trip client/server", lambda k: " / ".join(
            f"{k.preempted[r]:.2f}" for r in ROLES)),
        row("provider", lambda k: k.provider or "-"),
        [f"serialization in-process: 2 x (to_frames {to_us:.1f} + from_frames {from_us:.1f})",
         *(format_number(2 * (to_us + from_us)) for _ in labels)],
    ]
    return "\n".join(align(rows, label_columns=1, rules=(1, 1 + len(CATEGORIES), len(rows) - 1)))


def _value_cell(report: BudgetReport, label: str, budget: Cell | None, value: Any) -> str:
    status = report.status[label]
    if not status.available:
        return status.label
    if budget is None:
        return "error"
    shown = value(budget)
    if shown is None:
        return "no profile"
    return shown if isinstance(shown, str) else format_number(shown)


def _pair(values: Iterable[float]) -> str:
    return " / ".join(format_number(v) for v in values)


def _footnotes(report: BudgetReport) -> list[str]:
    config, budgets = report.config, report.config.budgets
    notes = [
        f"Method: per payload and configuration, the comm benchmark's ping-pong (client and "
        f"server in their own processes on 127.0.0.1) runs {budgets.reference_s:g} s "
        f"unprofiled, then loops while py-spy samples both processes' event-loop threads for "
        f"{budgets.window_s:g} s at {budgets.rate_hz} Hz (--idle --nonblocking); "
        f"{config.rounds} round(s), pooled. Each process's CPU time per round trip comes from "
        f"/proc over the same seconds: its kernel time is the syscalls row, its user time is "
        f"shared among the other on-CPU rows by their samples; the rows add the two "
        f"processes; wait = round trip - both processes' CPU time (time neither runs, net of "
        f"the time both do). py-spy alone is not trusted with on/off CPU: its samples land "
        f"mostly while a process sleeps or sits in a system call, not while it runs.",
        "Rules (first frame from the leaf up that one matches decides; "
        "benchmarks/_budget_rules.py):",
        *(f"  {_ROW_NAMES[rule.category]}: {rule.means}" for rule in RULES),
        "Cross-checks: 'on CPU, py-spy' is what the samples alone say (the non-wait share of "
        "the round trip), against /proc's user + kernel time. The in-process serialization "
        "is the median to_frames/from_frames of the very message in this process, paid by "
        "each side once per round trip: compare the serialization row.",
        _machine_note(report.environment),
    ]
    notes.extend(f"{label}: {status.label}: {status.detail}"
                 for label, status in report.status.items() if not status.available)
    notes.extend(f"{r.label} {size_name(r.size)} round {r.round + 1}: no profile: "
                 f"{r.recording.error}" for r in report.results if r.recording.error)
    notes.extend(f"{r.label} {size_name(r.size)} round {r.round + 1} failed: {r.error}"
                 for r in report.failures())
    return notes


def _machine_note(env: dict[str, Any]) -> str:
    """The machine and its load: on a busy one, the wait grows first."""
    start, end = (", ".join(f"{x:g}" for x in env[key])
                  for key in ("load_average", "load_average_end"))
    return (f"Measured: {env['cpu']}, {env['cpu_count']} CPUs, load average {start} at the "
            f"start and {end} at the end (1/5/15 min), Python {env['python']}, "
            f"distributed {env['distributed']}; code {env['source']}.")


def to_json(report: BudgetReport) -> dict[str, Any]:
    """The budget per payload and configuration (pooled, as tabled), the raw
    rounds, the rules, and how the run was made."""
    config = report.config
    return {
        "environment": report.environment,
        "config": {
            "configurations": [asdict(c) | {"dask_config": c.overrides}
                               for c in config.configurations],
            "sizes": list(config.sizes),
            "rounds": config.rounds,
            "quick": config.quick,
            "budgets": asdict(config.budgets),
            "categories": list(ROWS),
            "rules": {rule.category: rule.means for rule in RULES},
        },
        "status": {label: asdict(status) for label, status in report.status.items()},
        "serialization": {
            size_name(size): {"to_frames_us": to_us, "from_frames_us": from_us,
                              "per_round_trip_us": 2 * (to_us + from_us)}
            for size, (to_us, from_us) in report.serialization.items()
        },
        "budget": {
            size_name(size): {label: _cell_json(cell(report, size, label))
                              for label in config.labels if report.status[label].available}
            for size in config.sizes
        },
        "raw": [asdict(r) for r in report.results],
    }


def _cell_json(budget: Cell | None) -> dict[str, Any] | None:
    return None if budget is None else asdict(budget)
