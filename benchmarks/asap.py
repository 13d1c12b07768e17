"""``python -m benchmarks asap``: ASAP against BSP all-reduce, ring all-reduce
and plain async, training logistic regression on Dask workers.

Each worker runs on a simulated host with its egress rate-limited (see
:mod:`benchmarks._asap_testbed`; loopback without root) and computes each
local step in ``--compute-ms``; in the ``transient`` case one random worker
per round computes ``--slow-factor`` times slower, in the ``straggler`` case
rank 0 always does. Every mode runs the same number of rounds from the same
start on the same cluster, models travel worker to worker over ``--scheme``.

The target loss is ``f* + target_rel * (f(0) - f*)``, ``f*`` from a
centralised solver. ``--json OUT`` writes the transient case's records to
OUT and the straggler case's to ``OUT-straggler.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client

from benchmarks._asap_testbed import testbed
from dask_lcicomm.asap.client import train
from dask_lcicomm.asap.graphs import choose_graph
from dask_lcicomm.asap.modes import MODES
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.report import RunReport
from dask_lcicomm.asap.synthetic import SparseLogReg

CASES = ("transient", "straggler")
KEYS = ("mode", "graph", "workers", "reached_target", "time_to_target_s", "rounds_to_target",
        "bytes_to_target", "final_loss", "final_accuracy", "max_iteration_gap", "spectral_gap")


@dataclass
class CaseResult:
    case: str
    reports: list[RunReport]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks asap",
        description="ASAP (stochastic reduce + NOTIFY-ACK) against BSP all-to-all averaging, ring "
        "all-reduce and plain async, training logistic regression on Dask workers that each run "
        "on a simulated host with limited bandwidth (loopback without root).")
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds: the whole run in about 6-7 minutes on 2 cores")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the records to OUT")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write loss-vs-time/bytes PNGs to DIR")
    p.add_argument("--scheme", default="lci", help="comm scheme of the cluster (default: lci)")
    p.add_argument("--workers", type=int, default=8, help="number of workers (default: 8)")
    p.add_argument("--rate", default="100mbit", help="egress limit per simulated host (tc rate)")
    p.add_argument("--loopback", action="store_true", help="run on loopback even as root")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                   help="transient: a random worker slow each round; straggler: rank 0 always slow")
    p.add_argument("--degree", type=int, default=2, help="degree budget of the sparse graph")
    p.add_argument("--rounds", type=int, help="rounds per mode (default 400, quick 220)")
    p.add_argument("--straggler-rounds", type=int, help="rounds per mode, straggler case "
                   "(default 300, quick 170)")
    p.add_argument("--time-limit", type=float, default=150.0, help="seconds per mode at most")
    p.add_argument("--compute-ms", type=float, default=20.0, help="emulated duration of a local step")
    p.add_argument("--slow-factor", type=float, default=4.0, help="how much slower a slow step is")
    p.add_argument("--target-rel", type=float, default=0.15,
                   help="target loss f* + this * (f(0) - f*) (default: 0.15)")
    p.add_argument("--features", type=int, default=32768, help="model size (float64 values)")
    p.add_argument("--samples", type=int, default=4096, help="training samples per worker")
    p.add_argument("--record-every", type=int, help="rounds between loss points (default 1, quick 2)")
    p.add_argument("--seed", type=int, default=0, help="of the data, SGD batches and slowdowns")
    p.add_argument("--start-delay", type=float, default=2.0,
                   help="seconds between submitting a run and its common start")
    return p


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def record(report: RunReport, target: float) -> dict[str, Any]:
    """One run as the JSON record (exactly :data:`KEYS`)."""
    hit = report.first_below(target)
    return {
        "mode": report.mode, "graph": report.graph, "workers": len(report.workers),
        "reached_target": hit is not None,
        "time_to_target_s": None if hit is None else round(hit.t, 3),
        "rounds_to_target": None if hit is None else round(hit.rounds, 1),
        "bytes_to_target": None if hit is None else hit.bytes,
        "final_loss": report.final_loss, "final_accuracy": report.final_accuracy,
        "max_iteration_gap": report.max_iteration_gap(), "spectral_gap": round(report.spectral_gap, 4),
    }


def format_table(case: CaseResult, target: float) -> str:
    head = ("| mode | graph | reached | time to target [s] | rounds | MB to target | final loss "
            "| final acc | max gap (diameter) | spectral gap | wait/worker [s] | MB total |")
    lines = [f"{case.case} case (target loss {target:.4f}):", "", head,
             "|" + "---|" * head.count(" | ") + "---|"]
    for report in case.reports:
        r = record(report, target)

        def fmt(value: Any, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        mb = None if r["bytes_to_target"] is None else r["bytes_to_target"] / 1e6
        lines.append(
            f"| {r['mode']} | {r['graph']} | {'yes' if r['reached_target'] else 'no'} "
            f"| {fmt(r['time_to_target_s'], '.1f')} | {fmt(r['rounds_to_target'], '.0f')} "
            f"| {fmt(mb, ',.0f')} | {r['final_loss']:.4f} | {r['final_accuracy']:.3f} "
            f"| {r['max_iteration_gap']} ({report.diameter:g}) | {r['spectral_gap']:.3f} "
            f"| {report.wait_s:.1f} | {report.bytes_sent / 1e6:,.0f} |")
    return "\n".join(lines)


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
    out.append(f"asap/bsp time to target {t and round(t, 2)}, bytes {b and round(b, 2)} (<= 0.5 each): "
               f"{verdict(within(asap, bsp, 0.5, ('time_to_target_s', 'bytes_to_target')))}")
    if asap and bsp:
        rel = (asap["final_loss"] - bsp["final_loss"]) / bsp["final_loss"]
        out.append(f"asap final loss vs bsp {rel:+.2%} (within 2%): {verdict(abs(rel) <= 0.02)}")
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


def run(args: argparse.Namespace) -> tuple[list[CaseResult], float, float, str]:
    rounds = args.rounds or (220 if args.quick else 400)
    straggler_rounds = args.straggler_rounds or (170 if args.quick else 300)
    problem = SparseLogReg(n_features=args.features, nworkers=args.workers,
                           samples_per_worker=args.samples, seed=args.seed)
    t0 = time.monotonic()
    _, f_star = problem.solve()
    f_zero = problem.loss(problem.init_model())
    target = f_star + args.target_rel * (f_zero - f_star)
    _progress(f"f* = {f_star:.5f} (centralised solver, {time.monotonic() - t0:.1f} s), "
              f"f(0) = {f_zero:.5f}, target {target:.5f}")
    graph = choose_graph(args.workers, args.degree)
    _progress(f"sparse graph {graph.name}: spectral gap {graph.spectral_gap:.3f}, "
              f"diameter {graph.diameter:g}")
    results = []
    with tempfile.TemporaryDirectory(prefix="asap-testbed-") as logdir, \
            testbed(args.workers, args.scheme, args.rate, Path(logdir), args.loopback) as bed, \
            Client(bed.scheduler, timeout=60) as client:
        _progress(f"testbed: {bed.kind}; scheduler {bed.scheduler}")
        for case in args.cases:
            reports = []
            for mode in args.modes:
                n_rounds = rounds if case == "transient" else straggler_rounds
                _progress(f"[{case}] {mode}: {n_rounds} rounds ...")
                report = train(client, problem, mode=mode, graph=graph, rounds=n_rounds,
                               time_limit_s=args.time_limit, pacing=_case_pacing(case, args),
                               record_every=args.record_every or (2 if args.quick else 1),
                               start_delay_s=args.start_delay)
                _progress(f"[{case}] {mode}: {max(w.elapsed_s for w in report.workers):.1f} s, "
                          f"final loss {report.final_loss:.5f}")
                reports.append(report)
            results.append(CaseResult(case, reports))
    return results, f_star, target, bed.kind


def _json_path(out: Path, case: str) -> Path:
    return out if case == "transient" else out.with_name(f"{out.stem}-{case}{out.suffix or '.json'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES] + [c for c in args.cases if c not in CASES]
    if unknown:
        _parser().error(f"unknown modes or cases: {unknown}")
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    try:
        results, f_star, target, kind = run(args)
    except KeyboardInterrupt:
        _progress("interrupted; the testbed's processes and namespaces were removed")
        return 130
    print(f"testbed: {kind}; scheme {args.scheme}; {args.workers} workers; step {args.compute_ms:g} ms, "
          f"slow x{args.slow_factor:g}; f* = {f_star:.5f}\n")
    for case in results:
        print(format_table(case, target))
        print("\nTargets:\n" + "\n".join(f"- {line}" for line in targets(case, target)) + "\n")
        if args.json:
            path = _json_path(args.json, case.case)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([record(r, target) for r in case.reports], indent=2) + "\n")
            _progress(f"wrote {path}")
        if args.plot:
            from benchmarks._asap_plots import plot_case

            title = (f"a random worker x{args.slow_factor:g} slower each round" if case.case == "transient"
                     else f"rank 0 always x{args.slow_factor:g} slower")
            for path in plot_case(case.case, title, case.reports, f_star, target, args.plot):
                _progress(f"wrote {path}")
    _progress(f"asap benchmark took {time.monotonic() - started:.0f} s")
    return 0
