"""Command line: ``python -m benchmarks comm [--quick] [--schemes lci,tcp] [--json OUT]``.

This is the only layer that prints: progress goes to stderr (so that stdout
holds just the table and can be redirected), the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parser() -> argparse.ArgumentParser:
    from benchmarks.comm import BENCHMARK_NAMES

    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    comm = commands.add_parser(
        "comm",
        help="compare Dask comm backends side by side",
        description="Measure Dask comms (distributed.comm listen/connect/read/write), "
        "and the CPU time an idle LocalCluster burns, for several schemes in one run, "
        "alternating rounds between schemes, and print the per-scheme medians.",
    )
    comm.add_argument("--quick", action="store_true",
                      help="tiny budgets and 2 rounds: a smoke run of well under a minute "
                      "(most of it starting idle clusters)")
    comm.add_argument("--schemes", type=_csv, default=["lci", "tcp"],
                      help="comma-separated schemes (default: lci,tcp; ucxx also works "
                      "if distributed_ucxx is installed)")
    comm.add_argument("--json", type=Path, metavar="OUT",
                      help="also write raw per-round numbers and medians to OUT")
    comm.add_argument("--rounds", type=int, help="rounds per scheme (default: 5, quick: 2)")
    comm.add_argument("--benchmarks", type=_csv, metavar="NAMES",
                      help=f"comma-separated subset of: {','.join(BENCHMARK_NAMES)}")
    return parser


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_comm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from benchmarks import comm

    try:
        config = comm.make_config(args.schemes, args.quick, args.rounds, args.benchmarks)
    except ValueError as exc:
        parser.error(str(exc))
    _progress(
        f"comm benchmarks: schemes={','.join(config.schemes)} rounds={config.rounds} "
        f"{'(quick)' if config.quick else ''}"
    )
    report = comm.run(config, progress=_progress)
    print(comm.format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(comm.to_json(report), indent=2) + "\n")
        _progress(f"wrote {args.json}")
    return 1 if report.failures() else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "comm":
            return _run_comm(args, parser)
    except KeyboardInterrupt:
        _progress("interrupted; peer processes were stopped")
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
