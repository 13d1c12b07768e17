"""A saved run as a table, a page of the docs or figures, all from its JSON,
so that a published result is never typed by hand (the docs build calls
:func:`write_page` for every run in ``docs/results/``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._runner import csv, draw, format_number, format_ratio, progress

Json = dict[str, Any]


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def run_name(data: Json) -> str:
    """``<date> <command>, code <commit>``: how pages and the README name a run."""
    env = data["environment"]
    return f"{env['timestamp'][:10]} {data['command']}, code {env.get('source') or 'unknown'}"


def environment(data: Json) -> str:
    env, config = data["environment"], data["config"]
    quick = " (--quick: the numbers mean nothing)" if config["quick"] else ""
    return "\n".join([
        f"- command: `{' '.join(['python -m benchmarks', *env['argv'][1:]])}`",
        f"- when: {env['timestamp']}; code: `{env.get('source') or 'unknown'}`",
        f"- machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB, {env['platform']}",
        f"- Python {env['python']}, distributed {env['distributed']}, numpy {env['numpy']}",
        f"- load average at the start: {', '.join(f'{x:g}' for x in env['load_average'])}",
        f"- rounds: {config['rounds']}{quick}",
    ])


def results_table(
    data: Json, rows: list[str] | None = None, ratios: list[str] | None = None,
    labels: list[str] | None = None,
) -> str:
    """Per benchmark and metric, each configuration's median and the run's ratios (>1 favours
    the first named); ``rows`` (``benchmark:metric``), ``ratios``, ``labels`` choose a part."""
    by_row = {f"{r['benchmark']}:{r['metric']}": r for r in data["results"]}
    labels = labels or [c["label"] for c in data["config"]["configurations"]]
    ratios = ratios or list(data["config"]["ratios"])
    if unknown := [key for key in rows or [] if key not in by_row]:
        raise ValueError(f"no row {', '.join(unknown)} in this run; it has {', '.join(by_row)}")

    def median(numbers: Json | None) -> str:
        return "-" if not numbers or numbers["median"] is None else format_number(numbers["median"])

    table = []
    for key in rows or by_row:
        result = by_row[key]
        table.append([result["benchmark"], result["unit"],
                      *(median(result["per_configuration"].get(label)) for label in labels),
                      *(format_ratio(result["ratios"].get(name)) for name in ratios)])
    missing = [f"{label}: {s['label']}" for label, s in data["status"].items()
               if not s["available"] and label in labels]
    note = ["", "Not measured: " + "; ".join(missing) + "."] if missing else []
    return "\n".join([markdown_table(["benchmark", "unit", *labels, *ratios], table), *note])


def budget_table(data: Json) -> str:
    """Per payload: microseconds of CPU per round trip by category, both processes added,
    and the round trip itself."""
    sections = []
    for size, by_label in data["budget"].items():
        labels = [label for label, budget in by_label.items() if budget is not None]
        rows = [[category, *(format_number(by_label[label]["pair"][category]) for label in labels)]
                for category in data["config"]["categories"]]
        rows.append(["round trip, unprofiled",
                     *(format_number(by_label[label]["reference_us"]) for label in labels)])
        sections.append(markdown_table([f"{size}, us per round trip", *labels], rows))
    return "\n\n".join(sections)


def command_table(data: Json) -> str:
    """The run's tables as its command lays them out."""
    if data["command"] == "workloads":
        from benchmarks.workloads import report_page  # its measuring needs Dask: not imported here

        return report_page(data)
    return budget_table(data) if data["command"] == "budget" else results_table(data)


def page(data: Json, figures: list[Path], page_dir: Path) -> str:
    """The Markdown page of one run; ``figures`` are linked relative to it."""
    images = [f"![{path.stem}]({os.path.relpath(path, page_dir)})" for path in figures]
    return "\n\n".join([
        f"# {run_name(data)}",
        "Generated from the run's JSON by `python -m benchmarks report`; medians of the rounds, "
        "measured side by side in one run (absolute times are not comparable across runs).",
        environment(data),
        command_table(data),
        *images,
    ]) + "\n"


def write_page(results: Path, out: Path, figure_dir: Path | None = None) -> Path:
    """Write the page of the run saved in ``results`` (and its figures)."""
    from benchmarks.plots import plot

    data = json.loads(results.read_text())
    figures = [] if figure_dir is None else plot(data, figure_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(data, figures, out.parent))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report",
                                description="a saved run (--json) as a table, a page or figures")
    p.add_argument("results", type=Path, metavar="RESULTS.json")
    p.add_argument("--page", type=Path, metavar="OUT.md", help="write the run as a page there")
    p.add_argument("--plot", type=Path, metavar="DIR", help="draw the run's figures into DIR")
    p.add_argument("--rows", type=csv, metavar="BENCHMARK:METRIC,...", help="only these rows")
    p.add_argument("--labels", type=csv, metavar="NAMES", help="only these columns")
    p.add_argument("--ratios", type=csv, metavar="NAMES", help="only these ratios")
    args = p.parse_args(argv)
    if args.page is not None:
        progress(f"wrote {write_page(args.results, args.page, args.plot)}")
        return 0
    data = json.loads(args.results.read_text())
    if args.plot is not None:
        draw(data, args.plot)
        return 0
    try:
        chosen = args.rows or args.ratios or args.labels
        print(results_table(data, args.rows, args.ratios, args.labels) if chosen else command_table(data))
    except ValueError as exc:
        p.error(str(exc))
    return 0
