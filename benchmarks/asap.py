"""``python -m benchmarks asap``: ASAP against BSP all-reduce, ring all-reduce
and plain async, training a model on Dask workers: L2-regularised logistic
regression (``--model logreg``, convex) or a multi-layer perceptron
(``--model mlp``, not convex).

Each worker runs on a simulated host with its egress rate-limited (see
:mod:`benchmarks._testbed`; loopback without root) and computes each
local step in ``--compute-ms``; in the ``transient`` case one random worker
per round computes ``--slow-factor`` times slower, in the ``straggler`` case
rank 0 always does. Every mode runs the same number of rounds from the same
start on the same cluster, models travel worker to worker over ``--scheme``.

``--quick`` runs fewer rounds, and only the transient case unless
``--cases`` names both.

The target loss is ``f_ref + target_rel * (f(0) - f_ref)``, fixed before any
run: ``f_ref`` is the optimum ``f*`` from a centralised solver for logreg,
and the loss of a reference trained centrally on large batches for mlp.
``--json OUT`` writes the transient case's records to OUT and the straggler
case's to ``OUT-straggler.json`` beside it.

``--degrees 1,2,3,4`` runs asap alone once per degree budget instead (each on
the graph with the best spectral gap under it) and reports, per budget, the
graph's spectral gap and diameter and the rounds, time and bytes to target,
in one table and one figure (``asap-degrees.png``); a budget whose graph does
not reach the target within its rounds and time limit says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client

from benchmarks._runner import format_number, progress
from benchmarks._testbed import testbed
from benchmarks.report import markdown_table
from dask_lcicomm.asap.client import train
from dask_lcicomm.asap.graphs import Graph, choose_graph
from dask_lcicomm.asap.mlp import MLP
from dask_lcicomm.asap.modes import MODES
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.report import RunReport
from dask_lcicomm.asap.synthetic import SparseLogReg

CASES = ("transient", "straggler")
MODELS = {"logreg": "logistic regression", "mlp": "multi-layer perceptron"}
#: The target's distance from f_ref, as a share of f(0) - f_ref, unless given.
TARGET_REL = {"logreg": 0.15, "mlp": 0.25}
KEYS = ("model", "mode", "graph", "degree_budget", "workers", "reached_target", "time_to_target_s",
        "rounds_to_target", "bytes_to_target", "final_loss", "final_accuracy", "max_iteration_gap",
        "spectral_gap", "diameter")


@dataclass
class CaseResult:
    case: str
    reports: list[RunReport]
    #: With ``--degrees``: the degree budget of each report (all asap).
    degrees: list[int] | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks asap",
        description="ASAP (stochastic reduce + NOTIFY-ACK) against BSP all-to-all averaging, ring "
        "all-reduce and plain async, training a model on Dask workers that each run "
        "on a simulated host with limited bandwidth (loopback without root).")
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds, and the transient case alone unless --cases says otherwise")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the records to OUT")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write loss-vs-time/bytes PNGs to DIR")
    p.add_argument("--scheme", default="lci", help="comm scheme of the cluster (default: lci)")
    p.add_argument("--workers", type=int, default=8, help="number of workers (default: 8)")
    p.add_argument("--rate", default="100mbit", help="egress limit per simulated host (tc rate)")
    p.add_argument("--loopback", action="store_true", help="run on loopback even as root")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--cases", type=lambda s: s.split(","),
                   help="transient: a random worker slow each round; straggler: rank 0 always slow "
                   "(default: both, quick: transient)")
    p.add_argument("--model", choices=list(MODELS), default="logreg",
                   help="logreg (convex) or mlp (one hidden layer, not convex)")
    p.add_argument("--degree", type=int, default=2, help="degree budget of the sparse graph")
    p.add_argument("--degrees", type=lambda s: [int(d) for d in s.split(",")],
                   help="run asap once per degree budget (e.g. 1,2,3,4) instead of the modes")
    p.add_argument("--rounds", type=int, help="rounds per mode (default 400, quick 220)")
    p.add_argument("--straggler-rounds", type=int, help="rounds per mode, straggler case "
                   "(default 300, quick 170)")
    p.add_argument("--time-limit", type=float,
                   help="seconds per mode at most (default: the larger of 150 and twice the time "
                   "bsp's rounds need to move their models at --rate)")
    p.add_argument("--compute-ms", type=float, default=20.0, help="emulated duration of a local step")
    p.add_argument("--slow-factor", type=float, default=4.0, help="how much slower a slow step is")
    p.add_argument("--target-rel", type=float,
                   help="target loss f_ref + this * (f(0) - f_ref) (default: logreg 0.15, mlp 0.25)")
    p.add_argument("--features", type=int, default=32768, help="logreg model size (float64 values)")
    p.add_argument("--hidden", type=int, default=1024, help="mlp hidden units")
    p.add_argument("--samples", type=int, default=4096, help="training samples per worker")
    p.add_argument("--record-every", type=int, help="rounds between loss points (default 1, quick 2)")
    p.add_argument("--seed", type=int, default=0, help="of the data, SGD batches and slowdowns")
    p.add_argument("--start-delay", type=float, default=2.0,
                   help="seconds between submitting a run and its common start")
    return p


def record(report: RunReport, target: float, model: str = "logreg",
           degree_budget: int | None = None) -> dict[str, Any]:
    """One run as the JSON record (exactly :data:`KEYS`)."""
    hit = report.first_below(target)
    return {
        "model": model, "mode": report.mode, "graph": report.graph, "degree_budget": degree_budget,
        "workers": len(report.workers),
        "reached_target": hit is not None,
        "time_to_target_s": None if hit is None else round(hit.t, 3),
        "rounds_to_target": None if hit is None else round(hit.rounds, 1),
        "bytes_to_target": None if hit is None else hit.bytes,
        "final_loss": report.final_loss, "final_accuracy": report.final_accuracy,
        "max_iteration_gap": report.max_iteration_gap(), "spectral_gap": round(report.spectral_gap, 4),
        "diameter": report.diameter if report.diameter != float("inf") else None,
    }


def records_table(records: list[dict[str, Any]]) -> str:
    """A saved run (its records, as :func:`record` makes them): a row per record, a column per key."""
    head = list(records[0])

    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, int):  # counts: workers, rounds, bytes
            return f"{value:,}"
        if isinstance(value, float):
            return format_number(value)
        return "-" if value is None else str(value)

    return markdown_table(head, ([cell(record.get(key)) for key in head] for record in records))


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(case: CaseResult, target: float) -> str:
    head = ["mode", "graph", "reached", "time to target [s]", "rounds", "MB to target", "final loss",
            "final acc", "max gap (diameter)", "spectral gap", "wait/worker [s]", "MB total"]
    rows = []
    for report in case.reports:
        r = record(report, target)
        mb = None if r["bytes_to_target"] is None else r["bytes_to_target"] / 1e6
        rows.append([
            r["mode"], r["graph"], "yes" if r["reached_target"] else "no",
            _fmt(r["time_to_target_s"], ".1f"), _fmt(r["rounds_to_target"], ".0f"), _fmt(mb, ",.0f"),
            f"{r['final_loss']:.4f}", f"{r['final_accuracy']:.3f}",
            f"{r['max_iteration_gap']} ({report.diameter:g})", f"{r['spectral_gap']:.3f}",
            f"{report.wait_s:.1f}", f"{report.bytes_sent / 1e6:,.0f}",
        ])
    return f"{case.case} case (target loss {target:.4f}):\n\n" + markdown_table(head, rows)


def format_degrees(case: str, records: list[dict[str, Any]], target: float) -> str:
    """asap per degree budget (``records`` of one case): the graph's mixing
    against rounds and bytes to target."""
    head = ["degree budget", "graph", "spectral gap", "diameter", "reached", "rounds to target",
            "time to target [s]", "MB to target", "final loss", "max gap"]
    rows = []
    for r in records:
        reached = r["reached_target"]
        mb = r["bytes_to_target"] / 1e6 if reached else None
        rows.append([
            str(r["degree_budget"]), r["graph"], f"{r['spectral_gap']:.4f}",
            "inf" if r["diameter"] is None else format(r["diameter"], "g"),
            "yes" if reached else "not reached",
            str(r["rounds_to_target"]) if reached else "-",
            str(r["time_to_target_s"]) if reached else "-",
            _fmt(mb, ",.0f"), f"{r['final_loss']:.4f}", str(r["max_iteration_gap"]),
        ])
    return (f"{case} case, asap per degree budget (target loss {target:.4f}):\n\n"
            + markdown_table(head, rows))


def targets(case: CaseResult, target: float) -> list[str]:
    """The issue's targets as measured ratios; missing modes or misses say so."""
    by_mode = {r.mode: record(r, target) for r in case.reports}
    asap, bsp, ring, gossip = (by_mode.get(m) for m in ("asap", "bsp", "bsp-ring", "async"))
    out: list[str] = []

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        if a is None or b is None or a[key] is None or b[key] is None:
            return None
        return a[key] / b[key]

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "MISSED")

    def within(a: dict | None, b: dict | None, bound: float, keys: Sequence[str]) -> bool | None:
        """``a`` reached the target within ``bound`` times ``b``'s ``keys``;
        missing it where ``b`` reached it is a miss."""
        if a is None or b is None or not b["reached_target"]:
            return None
        return a["reached_target"] and all(
            (r := ratio(a, b, key)) is not None and r <= bound for key in keys
        )

    t, b = ratio(asap, bsp, "time_to_target_s"), ratio(asap, bsp, "bytes_to_target")
    out.append(f"asap/bsp time to target {t and round(t, 2)} (<= 0.2): "
               f"{verdict(within(asap, bsp, 0.2, ('time_to_target_s',)))}")
    out.append(f"asap/bsp bytes to target {b and round(b, 3)} (<= 0.1): "
               f"{verdict(within(asap, bsp, 0.1, ('bytes_to_target',)))}")
    if asap and bsp:
        points = 100 * (asap["final_accuracy"] - bsp["final_accuracy"])
        out.append(f"asap final accuracy {asap['final_accuracy']:.3f} vs bsp {bsp['final_accuracy']:.3f}, "
                   f"{points:+.1f} points (within 1): {verdict(abs(points) <= 1.0)}")
    if asap and gossip:
        ok = gossip["final_loss"] > asap["final_loss"] or not gossip["reached_target"]
        out.append(f"async final loss {gossip['final_loss']:.4f} vs asap {asap['final_loss']:.4f}, "
                   f"async reached target: {gossip['reached_target']} (async worse or misses): {verdict(ok)}")
    t, b = ratio(asap, ring, "time_to_target_s"), ratio(asap, ring, "bytes_to_target")
    out.append(f"asap/bsp-ring time to target {t and round(t, 2)} (<= 1), bytes {b and round(b, 2)} "
               f"(reported): {verdict(within(asap, ring, 1.0, ('time_to_target_s',)))}")
    for report in case.reports:
        if report.mode == "asap":
            gap = report.max_iteration_gap()
            out.append(f"asap iteration gap {gap} <= diameter {report.diameter:g}: "
                       f"{verdict(gap <= report.diameter)}")
    return out


def _case_pacing(case: str, args: argparse.Namespace) -> Pacing:
    if case == "transient":
        return Pacing(args.compute_ms / 1e3, args.slow_factor, transient=True, seed=args.seed)
    return Pacing(args.compute_ms / 1e3, args.slow_factor, straggler=0, seed=args.seed)


def _problem(args: argparse.Namespace) -> SparseLogReg | MLP:
    if args.model == "mlp":
        return MLP(hidden=args.hidden, nworkers=args.workers, samples_per_worker=args.samples,
                   seed=args.seed)
    return SparseLogReg(n_features=args.features, nworkers=args.workers,
                        samples_per_worker=args.samples, seed=args.seed)


#: tc's rate units, in bit/s.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}


def rate_bits(rate: str) -> float:
    """A ``tc`` rate such as ``"100mbit"`` in bit/s."""
    match = re.fullmatch(r"([0-9.]+)\s*([a-z]*)", rate.strip().lower())
    if match is None or match[2] not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 100mbit, 1gbit)")
    return float(match[1]) * _RATE_UNITS[match[2]]


def default_time_limit(workers: int, rounds: int, model_bytes: int, rate: str | None) -> float:
    """Seconds per mode when ``--time-limit`` is not given: enough for bsp,
    the mode that moves the most, to run ``rounds`` rounds. Each of its
    rounds sends ``workers - 1`` models out of every host's egress (0.65 s of
    256 KiB models at 32 hosts and 100 mbit); twice that leaves room for the
    steps, the slow worker and the CPU that 32 workers share. Modes that need
    less stop at their rounds, so the margin costs them nothing."""
    per_round = 0.0 if rate is None else (workers - 1) * model_bytes * 8 / rate_bits(rate)
    return max(150.0, 2 * rounds * per_round)


def _runs(args: argparse.Namespace) -> list[tuple[str, Graph]]:
    """(mode, sparse graph) of each run of a case."""
    if args.degrees:
        graphs = [choose_graph(args.workers, degree) for degree in args.degrees]
        return [("asap", graph) for graph in graphs]
    return [(mode, choose_graph(args.workers, args.degree)) for mode in args.modes]


def run(args: argparse.Namespace) -> tuple[list[CaseResult], float, float, str]:
    rounds = args.rounds or (220 if args.quick else 400)
    straggler_rounds = args.straggler_rounds or (170 if args.quick else 300)
    problem = _problem(args)
    t0 = time.monotonic()
    _, f_ref = problem.solve()
    f_zero = problem.loss(problem.init_model())
    target_rel = args.target_rel if args.target_rel is not None else TARGET_REL[args.model]
    target = f_ref + target_rel * (f_zero - f_ref)
    progress(f"f_ref = {f_ref:.5f} (centralised, {time.monotonic() - t0:.1f} s), "
              f"f(0) = {f_zero:.5f}, target {target:.5f}")
    time_limit = args.time_limit or default_time_limit(
        args.workers, max(rounds, straggler_rounds), problem.init_model().nbytes,
        None if args.loopback else args.rate)
    progress(f"time limit per mode {time_limit:.0f} s")
    runs = _runs(args)
    for graph in dict.fromkeys(graph for _, graph in runs):
        progress(f"sparse graph {graph.name}: spectral gap {graph.spectral_gap:.3f}, "
                  f"diameter {graph.diameter:g}")
    results = []
    with tempfile.TemporaryDirectory(prefix="asap-testbed-") as logdir, \
            testbed(args.workers, args.scheme, args.rate, Path(logdir), args.loopback) as bed, \
            Client(bed.scheduler, timeout=60) as client:
        progress(f"testbed: {bed.kind}; scheduler {bed.scheduler}")
        for case in args.cases:
            reports = []
            for mode, graph in runs:
                n_rounds = rounds if case == "transient" else straggler_rounds
                progress(f"[{case}] {mode} on {graph.name}: {n_rounds} rounds ...")
                report = train(client, problem, mode=mode, graph=graph, rounds=n_rounds,
                               time_limit_s=time_limit, pacing=_case_pacing(case, args),
                               record_every=args.record_every or (2 if args.quick else 1),
                               start_delay_s=args.start_delay)
                progress(f"[{case}] {mode}: {max(w.elapsed_s for w in report.workers):.1f} s, "
                          f"final loss {report.final_loss:.5f}; testbed RSS {bed.rss() / 2**20:,.0f} MiB")
                reports.append(report)
            results.append(CaseResult(case, reports, args.degrees))
    return results, f_ref, target, bed.kind


def _json_path(out: Path, case: str) -> Path:
    return out if case == "transient" else out.with_name(f"{out.stem}-{case}{out.suffix or '.json'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.cases = args.cases or (["transient"] if args.quick else list(CASES))
    unknown = [m for m in args.modes if m not in MODES] + [c for c in args.cases if c not in CASES]
    if unknown:
        _parser().error(f"unknown modes or cases: {unknown}")
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    try:
        results, f_ref, target, kind = run(args)
    except KeyboardInterrupt:
        progress("interrupted; the testbed's processes and namespaces were removed")
        return 130
    print(f"testbed: {kind}; scheme {args.scheme}; {args.workers} workers; model {args.model}; "
          f"step {args.compute_ms:g} ms, slow x{args.slow_factor:g}; f_ref = {f_ref:.5f}\n")
    for case in results:
        if case.degrees:
            records = [record(r, target, args.model, degree)
                       for r, degree in zip(case.reports, case.degrees, strict=True)]
            print(format_degrees(case.case, records, target) + "\n")
        else:
            print(format_table(case, target))
            print("\nTargets:\n" + "\n".join(f"- {line}" for line in targets(case, target)) + "\n")
            records = [record(r, target, args.model) for r in case.reports]
        if args.json:
            path = _json_path(args.json, case.case)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(records, indent=2) + "\n")
            progress(f"wrote {path}")
        if args.plot:
            from benchmarks._asap_plots import plot_case, plot_degrees

            if case.degrees:
                paths = [plot_degrees(case.case, records, args.workers, MODELS[args.model], args.plot)]
            else:
                title = (f"a random worker x{args.slow_factor:g} slower each round"
                         if case.case == "transient" else f"rank 0 always x{args.slow_factor:g} slower")
                offset = f_ref if args.model == "logreg" else 0.0
                paths = plot_case(case.case, f"{MODELS[args.model]}, {args.workers} workers: {title}",
                                  case.reports, offset, target, args.plot)
            for path in paths:
                progress(f"wrote {path}")
    progress(f"asap benchmark took {time.monotonic() - started:.0f} s")
    return 0
