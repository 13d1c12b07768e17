"""Command line:

* ``python -m benchmarks comm [--quick] [--schemes lci,tcp] [--json OUT]``
* ``python -m benchmarks variants [--quick] [--variants NAMES] [--json OUT]``
* ``python -m benchmarks dask [--quick] [--schemes lci,tcp] [--json OUT]``
* ``python -m benchmarks asap [--quick] --json OUT [--plot DIR]`` (see ``benchmarks/asap.py``)

This is the only layer that prints: progress goes to stderr (so that stdout
holds just the table and can be redirected), the table to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _common_options(
    command: argparse.ArgumentParser,
    *,
    quick_help: str,
    rounds_help: str,
    names: Sequence[str] | None = None,
) -> None:
    """The options every command shares: budgets, selection and output;
    ``names`` are what ``--benchmarks`` chooses from (default: the comm ones)."""
    from benchmarks._harness import BENCHMARK_NAMES

    command.add_argument("--quick", action="store_true", help=quick_help)
    command.add_argument("--json", type=Path, metavar="OUT",
                         help="also write raw per-round numbers and medians to OUT")
    command.add_argument("--rounds", type=int, help=rounds_help)
    command.add_argument("--benchmarks", type=_csv, metavar="NAMES",
                         help=f"comma-separated subset of: {','.join(names or BENCHMARK_NAMES)}")


def _schemes_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--schemes", dest="selection", type=_csv, metavar="SCHEMES",
                         default=["lci", "tcp"],
                         help="comma-separated schemes (default: lci,tcp; ucxx also works "
                         "if distributed_ucxx is installed)")


def _parser() -> argparse.ArgumentParser:
    from benchmarks.variants import VARIANT_NAMES

    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    comm = commands.add_parser(
        "comm",
        help="compare Dask comm backends side by side",
        description="Measure Dask comms (distributed.comm listen/connect/read/write), "
        "and the CPU time an idle LocalCluster burns, for several schemes in one run, "
        "alternating rounds between schemes, and print the per-scheme medians.",
    )
    _common_options(comm,
                    quick_help="tiny budgets and 2 rounds: a smoke run of well under a minute "
                    "(most of it starting idle clusters)",
                    rounds_help="rounds per scheme (default: 5, quick: 2)")
    _schemes_option(comm)
    variants = commands.add_parser(
        "variants",
        help="ablation: lci with one knob switched, vs default lci and tcp",
        description="Measure the default lci configuration, tcp, and variants of lci that "
        "each switch one knob of distributed.comm.lci (set in both peer processes), "
        "alternating rounds among all of them, and print each variant's "
        "ratio to the default lci. Full run: ~7.5 minutes on 2 cores.",
    )
    _common_options(variants,
                    quick_help="comm's tiny budgets and 1 round: a smoke run of under a minute",
                    rounds_help="rounds per configuration (default: 7, quick: 1)")
    variants.add_argument("--variants", dest="selection", type=_csv, metavar="NAMES",
                          help=f"comma-separated subset of: {','.join(VARIANT_NAMES)} "
                          "(default lci and tcp always run)")
    _dask_command(commands)
    return parser


def _dask_command(commands: argparse._SubParsersAction) -> None:
    from benchmarks.dask import GRAPH_NAMES

    command = commands.add_parser(
        "dask",
        help="real Dask graphs on a LocalCluster per scheme, plus in-process reference",
        description="Run the same Dask graphs (worker-to-worker moves, gathers to the "
        "client, an array expression, a tree of small tasks, a dataframe shuffle) on a "
        "LocalCluster(protocol=<scheme>, n_workers=2, processes=True) per scheme and on "
        "LocalCluster(processes=False) (inproc: no communication), alternating rounds, "
        "and print the median seconds per graph. Full run: ~5 minutes on 2 cores.",
    )
    _common_options(command, names=GRAPH_NAMES,
                    quick_help="small graphs and 1 round: a smoke run of under a minute",
                    rounds_help="rounds per configuration (default: 3, quick: 1)")
    _schemes_option(command)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(module: ModuleType, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run one command's benchmarks, print its table, optionally write JSON;
    exit status 1 if any round failed."""
    try:
        config = module.make_config(args.selection, args.quick, args.rounds, args.benchmarks)
    except ValueError as exc:
        parser.error(str(exc))
    _progress(
        f"{args.command} benchmarks: {','.join(config.labels)} rounds={config.rounds} "
        f"{'(quick)' if config.quick else ''}"
    )
    report = module.run(config, progress=_progress)
    print(module.format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(module.to_json(report), indent=2) + "\n")
        _progress(f"wrote {args.json}")
    return 1 if report.failures() else 0


def _command_module(command: str) -> ModuleType:
    """``benchmarks.<command>``: each command module offers the same API
    (``make_config``, ``run``, ``format_table``, ``to_json``)."""
    return importlib.import_module(f"benchmarks.{command}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["asap"]:  # its own options and records: see benchmarks/asap.py
        from benchmarks.asap import main as asap_main

        return asap_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(_command_module(args.command), args, parser)
    except KeyboardInterrupt:
        _progress("interrupted; peer processes were stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
