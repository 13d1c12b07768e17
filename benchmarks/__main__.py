"""Command line:

* ``python -m benchmarks comm [--quick] [--schemes NAMES] [--baseline PATH] [--json OUT] [--plot DIR]``
* ``python -m benchmarks variants [--quick] [--variants NAMES] [--json OUT] [--plot DIR]``
* ``python -m benchmarks dask [--quick] [--schemes lci,tcp,ucxx] [--baseline PATH] [--json OUT] [--plot DIR]``
* ``python -m benchmarks all [--quick] [--baseline PATH] [--json OUT] [--plot DIR]``: comm, dask
  and variants one after the other
* ``python -m benchmarks budget [--quick] [--configs NAMES] [--sizes SIZES] [--json OUT] [--plot DIR]``:
  where a small-message round trip spends its time (see ``benchmarks/budget.py``)
* ``python -m benchmarks plot RESULTS.json --plot DIR``: draw a saved run again
* ``python -m benchmarks report RESULTS.json [--page OUT.md [--plot DIR]] [--rows ...]``: a saved
  run as a page of the docs, or its table (see ``benchmarks/report.py``)
* ``python -m benchmarks asap [--quick] --json OUT [--plot DIR]`` (see ``benchmarks/asap.py``)
* ``python -m benchmarks workloads [--quick] [--settings ...] [--json OUT]``: the workloads users
  run, on one host and across simulated hosts (see ``benchmarks/workloads.py``)

``--baseline PATH`` adds ``lci@baseline``: lci as built in PATH (``pip install --no-deps
--target PATH <checkout>``), every process of it importing dask_lcicomm from there.

This is the only layer that prints: progress bars go to stderr (so that stdout
holds just the tables and can be redirected), the tables to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks._progress import ProgressBar


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
    from benchmarks._comm_suite import BENCHMARK_NAMES

    _output_options(command, quick_help)
    command.add_argument("--rounds", type=int, help=rounds_help)
    command.add_argument("--benchmarks", type=_csv, metavar="NAMES",
                         help=f"comma-separated subset of: {','.join(names or BENCHMARK_NAMES)}")


def _output_options(command: argparse.ArgumentParser, quick_help: str) -> None:
    command.add_argument("--quick", action="store_true", help=quick_help)
    command.add_argument("--json", type=Path, metavar="OUT",
                         help="also write raw per-round numbers and medians to OUT")
    command.add_argument("--plot", type=Path, metavar="DIR",
                         help="also draw the figures (PNG) into DIR")


def _schemes_option(command: argparse.ArgumentParser, dest: str = "selection") -> None:
    """``--schemes``; None when not given, so that each command runs its own
    default (comm adds lci pinned to its providers)."""
    from benchmarks.comm import DEFAULT_NAMES, DEFAULT_SCHEMES, PINNED

    command.add_argument("--schemes", dest=dest, type=_csv, metavar="SCHEMES",
                         help=f"comma-separated schemes, for comm also {','.join(PINNED)} (lci "
                         f"pinned to one provider; default: comm {','.join(DEFAULT_NAMES)}, "
                         f"dask {','.join(DEFAULT_SCHEMES)}; one that is not installed shows "
                         "as such in the tables)")


def _baseline_option(command: argparse.ArgumentParser) -> None:
    from benchmarks._configurations import BASELINE_BUILD

    command.add_argument("--baseline", metavar="PATH",
                         help=f"also measure {BASELINE_BUILD}: lci as built in PATH by "
                         "'pip install --no-deps --target PATH <checkout>' (an earlier commit), "
                         "every process of it importing dask_lcicomm from PATH; adds the ratio "
                         f"lci/{BASELINE_BUILD}")


def _variants_option(command: argparse.ArgumentParser, dest: str = "selection") -> None:
    from benchmarks.variants import VARIANT_NAMES

    command.add_argument("--variants", dest=dest, type=_csv, metavar="NAMES",
                         help=f"comma-separated subset of: {','.join(VARIANT_NAMES)} "
                         "(default lci and tcp always run)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    comm = commands.add_parser(
        "comm",
        help="compare Dask comm backends side by side",
        description="Measure Dask comms (distributed.comm listen/connect/read/write): "
        "ping-pong 8 B .. 64 MiB, flood at 8 B and 16 KiB with 1, 4 and 16 senders, "
        "nchains with 1 .. 1024 chains, and the CPU time an idle LocalCluster burns, for "
        "several schemes, and lci pinned to its tcp and ucx providers, in one run, "
        "alternating rounds between them, and print the medians of each. Full run: ~6 "
        "minutes on 2 cores for lci and tcp, about 3 more per further configuration.",
    )
    _common_options(comm,
                    quick_help="tiny budgets and 1 round: a smoke run of about half a minute",
                    rounds_help="rounds per scheme (default: 5, quick: 1)")
    _schemes_option(comm)
    _baseline_option(comm)
    variants = commands.add_parser(
        "variants",
        help="ablation: lci with one knob switched, vs default lci and tcp",
        description="Measure the default lci configuration, tcp, and variants of lci that "
        "each switch one knob of distributed.comm.lci (set in both peer processes), "
        "alternating rounds among all of them, and print each variant's "
        "ratio to the default lci. Full run: ~8 minutes on 2 cores.",
    )
    _common_options(variants,
                    quick_help="comm's tiny budgets and 1 round: a smoke run of under a minute",
                    rounds_help="rounds per configuration (default: 5, quick: 1)")
    _variants_option(variants)
    _dask_command(commands)
    _budget_command(commands)
    _all_command(commands)
    _plot_command(commands)
    _report_command(commands)
    # Listed for --help only: main() hands "asap" and its own options to benchmarks.asap.
    commands.add_parser(
        "asap", help="ASAP against bsp, bsp-ring and async on simulated hosts (8 by default) "
        "(see: python -m benchmarks asap --help)",
    )
    commands.add_parser(
        "workloads", help="workloads adapted from the Dask maintainers' benchmarks, per scheme, "
        "on one host and across simulated hosts (see: python -m benchmarks workloads --help)",
    )
    return parser


def _dask_command(commands: argparse._SubParsersAction) -> None:
    from benchmarks.dask import GRAPH_NAMES

    command = commands.add_parser(
        "dask",
        help="real Dask graphs on a LocalCluster per scheme, plus in-process reference",
        description="Run the same Dask graphs (worker-to-worker moves, gathers to the "
        "client, rechunks, an array expression, a dataframe shuffle, a tree of small tasks, "
        "a fine-grained stencil) on a LocalCluster(protocol=<scheme>, n_workers=2, "
        "processes=True) per scheme and on LocalCluster(processes=False) (inproc: no "
        "communication), alternating rounds, and print the median seconds per graph. "
        "Full run: ~8 minutes on 2 cores.",
    )
    _common_options(command, names=GRAPH_NAMES,
                    quick_help="small graphs and 1 round: a smoke run of under a minute",
                    rounds_help="rounds per configuration (default: 3, quick: 1)")
    _schemes_option(command)
    _baseline_option(command)


def _budget_command(commands: argparse._SubParsersAction) -> None:
    from benchmarks._comm_suite import size_name
    from benchmarks.budget import CONFIGURATIONS, SIZES

    command = commands.add_parser(
        "budget",
        help="where a small-message round trip spends its time, by category",
        description="Profile both peers of the ping-pong with py-spy (8 B, 1 KiB and 16 KiB "
        "payloads; lci over shm, the same with shm.poll-window=500us or progress=thread, lci "
        "over its tcp provider, tcp, ucxx, and floor: Dask's serialization over bare asyncio "
        "streams, the least a Dask comm does) and print the us per round trip of serialization, event-loop "
        "hops, syscalls and doorbells, the lci codec and layers, Dask's comm layer and the "
        "wait, next to the measured round trip and to_frames/from_frames timed in-process. "
        "Full run: ~3 minutes on 2 cores.",
    )
    _output_options(command, quick_help="short windows and 1 round: a smoke run of under a minute")
    command.add_argument("--rounds", type=int, help="rounds per configuration, pooled "
                         "(default: 2, quick: 1)")
    command.add_argument("--configs", dest="selection", type=_csv, metavar="NAMES",
                         help="comma-separated subset of: "
                         f"{','.join(c.label for c in CONFIGURATIONS)}")
    command.add_argument("--sizes", dest="benchmarks", type=_csv, metavar="SIZES",
                         help=f"comma-separated subset of: {','.join(map(size_name, SIZES))}")


def _all_command(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser(
        "all",
        help=f"{', '.join(ALL_COMMANDS)} one after the other",
        description=f"Run {', '.join(ALL_COMMANDS)} with their default budgets and print each "
        "table. Full run: ~22 minutes on 2 cores.",
    )
    _output_options(command, quick_help="every command's --quick: a smoke run")
    _schemes_option(command, dest="schemes")
    _baseline_option(command)
    _variants_option(command, dest="variants")


def _plot_command(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser(
        "plot", help="draw the figures of a saved run (its --json) again",
        description="Read what --json wrote (any command, or all) and draw its figures.",
    )
    command.add_argument("results", type=Path, metavar="RESULTS.json")
    command.add_argument("--plot", type=Path, metavar="DIR", required=True,
                         help="directory for the figures (PNG)")


def _report_command(commands: argparse._SubParsersAction) -> None:
    command = commands.add_parser(
        "report", help="write a saved run (its --json) as a Markdown page",
        description="Read what --json wrote for comm, dask, variants or budget and write a page "
                    "with the run's environment, its tables and (with --plot) its figures.",
    )
    command.add_argument("results", type=Path, metavar="RESULTS.json")
    command.add_argument("--page", type=Path, metavar="OUT.md",
                         help="write the page there (else print the run's table)")
    command.add_argument("--plot", type=Path, metavar="DIR", help="with --page: the figures' directory")
    command.add_argument("--rows", type=_csv, metavar="BENCHMARK:METRIC,...",
                         help="without --page: only these rows (pingpong-8B:latency, ...)")
    command.add_argument("--labels", type=_csv, metavar="NAMES", help="without --page: only these columns")
    command.add_argument("--ratios", type=_csv, metavar="NAMES", help="without --page: only these ratios")


#: What ``all`` runs, in this order.
ALL_COMMANDS = ("comm", "dask", "variants")

#: The commands that take ``--baseline`` (``all`` hands it to these).
BASELINE_COMMANDS = ("comm", "dask")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _make_config(command: str, args: argparse.Namespace, selection: Any,
                 parser: argparse.ArgumentParser) -> Any:
    """The command's run configuration; a bad selection is a usage error."""
    extra: dict[str, Any] = {}
    if command in BASELINE_COMMANDS and args.baseline is not None:
        extra["baseline"] = args.baseline
    try:
        return _command_module(command).make_config(
            selection, args.quick, getattr(args, "rounds", None), getattr(args, "benchmarks", None),
            **extra)
    except ValueError as exc:
        parser.error(str(exc))


def _measure(command: str, config: Any, progress: ProgressBar) -> dict[str, Any]:
    """Run one command and print its table; its JSON, with the command's name in it."""
    module = _command_module(command)
    report = module.run(config, progress=progress)
    progress.close()
    print(module.format_table(report), end="\n\n", flush=True)
    return {"command": command, **module.to_json(report), "failed": len(report.failures())}


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run one command's benchmarks, print its table, optionally write JSON
    and figures; exit status 1 if any round failed."""
    config = _make_config(args.command, args, args.selection, parser)
    with ProgressBar() as progress:
        data = _measure(args.command, config, progress)
    _write(args, data)
    return 1 if data["failed"] else 0


def _run_all(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Every command of :data:`ALL_COMMANDS` (all configured first, so that a
    bad selection stops the run before anything is measured)."""
    selections = {"comm": args.schemes, "dask": _schemes_only(args.schemes),
                  "variants": args.variants}
    configs = {command: _make_config(command, args, selections[command], parser)
               for command in ALL_COMMANDS}
    data: dict[str, Any] = {"command": "all"}
    with ProgressBar() as progress:
        for command, config in configs.items():
            data[command] = _measure(command, config, progress)
            _write_json(args, data)  # a later command failing loses nothing measured
    _write(args, data)
    return 1 if any(data[command]["failed"] for command in ALL_COMMANDS) else 0


def _schemes_only(names: list[str] | None) -> list[str] | None:
    """``names`` without comm's pinned lci configurations, which are no
    schemes a cluster could be started with."""
    from benchmarks.comm import PINNED

    return None if names is None else [name for name in names if name not in PINNED] or None


def _write_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")


def _write(args: argparse.Namespace, data: dict[str, Any]) -> None:
    _write_json(args, data)
    if args.json:
        _progress(f"wrote {args.json}")
    if args.plot:
        for path in _plot(data, args.plot):
            _progress(f"wrote {path}")


def _plot(data: dict[str, Any], outdir: Path) -> list[Path]:
    """The figures of one command's JSON, or of each command in an ``all`` JSON."""
    from benchmarks.plots import plot

    if data["command"] == "all":
        return [path for command in ALL_COMMANDS for path in plot(command, data[command], outdir)]
    return plot(data["command"], data, outdir)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from benchmarks.report import results_table, write_page

    if args.page is not None:
        _progress(f"wrote {write_page(args.results, args.page, args.plot)}")
        return 0
    data = json.loads(args.results.read_text())
    try:
        print(results_table(data, args.rows, args.ratios, args.labels))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


def _command_module(command: str) -> ModuleType:
    """``benchmarks.<command>``: each command module offers the same API
    (``make_config``, ``run``, ``format_table``, ``to_json``)."""
    return importlib.import_module(f"benchmarks.{command}")


def _interrupt(signum: int, frame: Any) -> None:
    """A SIGTERM (``kill``, a batch system's time limit) stops a run as Ctrl-C
    does, so that the clusters, testbeds and simulated hosts it made are
    removed on the way out: by default it ended the process at once and left
    them all behind."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["asap"]:  # its own options and records: see benchmarks/asap.py
        from benchmarks.asap import main as asap_main

        return asap_main(argv[1:])
    if argv[:1] == ["workloads"]:  # likewise: see benchmarks/workloads.py
        from benchmarks.workloads import main as workloads_main

        return workloads_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plot":
            for path in _plot(json.loads(args.results.read_text()), args.plot):
                _progress(f"wrote {path}")
            return 0
        if args.command == "report":
            return _report(args, parser)
        if args.command == "all":
            return _run_all(args, parser)
        return _run(args, parser)
    except KeyboardInterrupt:
        _progress("interrupted; peer processes were stopped")
        return 130


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
