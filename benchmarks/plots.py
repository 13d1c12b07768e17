"""Figures of a run, drawn from its JSON, so that a saved run can be drawn
again: medians, with bars or bands over the fastest and slowest round, so
that a reader sees how much of a difference is noise."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none wanted

import matplotlib.pyplot as plt  # after choosing the backend
import numpy as np
from matplotlib.ticker import FuncFormatter

Json = Mapping[str, Any]

_SIZE = (7.5, 4.5)
_DPI = 110


def _results(data: Json, benchmark_prefix: str, metric: str) -> list[Json]:
    return [r for r in data["results"]
            if r["benchmark"].startswith(benchmark_prefix) and r["metric"] == metric]


def _specs(data: Json) -> dict[str, Json]:
    return {spec["name"]: spec for spec in data["config"]["benchmarks"]}


def _measured(data: Json) -> list[str]:
    return [label for label, status in data["status"].items() if status["available"]]


def _spread(result: Json, label: str) -> tuple[float, float, float] | None:
    numbers = result["per_configuration"][label]
    rounds = [v for v in numbers["rounds"] if v is not None]
    if numbers["median"] is None or not rounds:
        return None
    return numbers["median"], min(rounds), max(rounds)


def _title(data: Json, what: str) -> str:
    env = data["environment"]
    quick = ", --quick: numbers mean nothing" if data["config"]["quick"] else ""
    return (f"{what}\nmedian of {data['config']['rounds']} round(s), "
            f"{env['cpu_count']} CPUs, distributed {env['distributed']}{quick}")


def _not_measured(data: Json) -> str:
    missing = [f"{label}: {status['label']}" for label, status in data["status"].items()
               if not status["available"]]
    return "not measured: " + "; ".join(missing) if missing else ""


def _save(fig: Any, data: Json, outdir: Path, name: str) -> Path:
    note = _not_measured(data)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    path = outdir / name
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _curve(ax: Any, data: Json, results: list[Json], x_of: Callable[[Json], float]) -> None:
    for label in _measured(data):
        points = sorted(
            (x_of(r), *spread) for r in results if (spread := _spread(r, label)) is not None
        )
        if not points:
            continue
        x, median, low, high = map(np.array, zip(*points, strict=True))
        (line,) = ax.plot(x, median, marker="o", label=label)
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)


def _sweep(data: Json, outdir: Path, metric: str, ylabel: str, name: str) -> Path:
    results = _results(data, "pingpong-", metric)
    specs = _specs(data)
    fig, ax = plt.subplots(figsize=_SIZE)
    _curve(ax, data, results, lambda r: specs[r["benchmark"]]["payload_bytes"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted((specs[r["benchmark"]]["payload_bytes"], r["benchmark"].split("-")[1])
                   for r in results)
    ax.set_xticks([size for size, _ in ticks], [name for _, name in ticks], rotation=45)
    ax.set_xlabel("message size (one ping-pong message)")
    ax.set_ylabel(ylabel)
    ax.set_title(_title(data, f"Ping-pong {metric} against message size"), fontsize=10)
    return _save(fig, data, outdir, name)


def _grouped_bars(ax: Any, data: Json, results: list[Json], labels: Sequence[str]) -> None:
    width = 0.8 / max(len(labels), 1)
    positions = np.arange(len(results))
    for i, label in enumerate(labels):
        spreads = [_spread(r, label) for r in results]
        median = np.array([s[0] if s else np.nan for s in spreads])
        error = np.array([[s[0] - s[1], s[2] - s[0]] if s else [0, 0] for s in spreads]).T
        ax.bar(positions + (i - (len(labels) - 1) / 2) * width, median, width,
               yerr=error if len(error) else None, capsize=2, label=label)
    ax.set_xticks(positions, [r["benchmark"] for r in results], rotation=30, ha="right")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)


def _flood(data: Json, outdir: Path) -> Path:
    fig, ax = plt.subplots(figsize=_SIZE)
    _grouped_bars(ax, data, _results(data, "flood-", "rate"), _measured(data))
    ax.set_ylabel("messages/s (higher is better)")
    ax.set_title(_title(data, "Flood: message rate of one-way writes, by size and senders"),
                 fontsize=10)
    return _save(fig, data, outdir, "comm-flood.png")


def _nchains(data: Json, outdir: Path) -> Path:
    specs = _specs(data)
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(_SIZE[0] * 1.4, _SIZE[1]))
    for ax, metric, ylabel in ((rate, "rate", "round trips/s, all comms (higher is better)"),
                               (latency, "latency", "us per round trip, each comm")):
        _curve(ax, data, _results(data, "nchains-", metric), lambda r: specs[r["benchmark"]]["comms"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent chains (comms)")
        ax.set_ylabel(ylabel)
    fig.suptitle(_title(data, "nchains: latency under load"), fontsize=10)
    return _save(fig, data, outdir, "comm-nchains.png")


def plot_comm(data: Json, outdir: Path) -> list[Path]:
    def measured(prefix: str) -> bool:
        return any(r["benchmark"].startswith(prefix) for r in data["results"])

    figures = []
    if measured("pingpong-"):
        figures += [
            _sweep(data, outdir, "latency", "us per round trip (lower is better)", "comm-latency.png"),
            _sweep(data, outdir, "bandwidth", "MiB/s, both directions (higher is better)",
                   "comm-bandwidth.png"),
        ]
    if measured("flood-"):
        figures.append(_flood(data, outdir))
    if measured("nchains-"):
        figures.append(_nchains(data, outdir))
    return figures


def _headlines(data: Json) -> list[Json]:
    seen: dict[str, Json] = {}
    for result in data["results"]:
        seen.setdefault(result["benchmark"], result)
    return list(seen.values())


def plot_variants(data: Json, outdir: Path) -> list[Path]:
    results = _headlines(data)
    baseline = data["config"]["configurations"][0]["label"]
    rows = [label for label in data["status"] if label != baseline]
    fig, ax = plt.subplots(figsize=(_SIZE[0], 1.5 + 0.1 * len(rows) * max(len(results), 1)))
    height = 0.8 / max(len(results), 1)
    positions = np.arange(len(rows))
    for i, result in enumerate(results):
        ratios = np.array([result["ratios"].get(f"{row}/{baseline}") for row in rows],
                          dtype=float)  # None -> nan: no bar
        # Bars grow from 1 (no effect) towards the ratio, left when worse.
        ax.barh(positions + (i - (len(results) - 1) / 2) * height, ratios - 1, height,
                left=1.0, label=result["benchmark"])
    for position, row in enumerate(rows):  # positions == arange(len(rows))
        status = data["status"][row]
        if not status["available"]:
            ax.text(1.0, position, f"  {status['label']}", va="center", fontsize=8, color="dimgray")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_yticks(positions, rows)
    ax.invert_yaxis()
    ax.set_xlabel(f"ratio to default {baseline} (>1 is better)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.set_title(_title(data, f"Variants: one knob switched against default {baseline}"),
                 fontsize=10)
    return [_save(fig, data, outdir, "variants.png")]


def plot_dask(data: Json, outdir: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(_SIZE[0] * 1.2, _SIZE[1]))
    _grouped_bars(ax, data, _results(data, "", "time"), _measured(data))
    ax.set_yscale("log")
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(_title(data, "Dask graphs on a 2-worker LocalCluster"), fontsize=10)
    return [_save(fig, data, outdir, "dask.png")]


def plot_budget(data: Json, outdir: Path) -> list[Path]:
    """Per size, a stacked bar of a round trip's categories per configuration,
    a tick for the unprofiled round trip, a line for serialization alone."""
    return [_plot_budget_size(data, size, cells, outdir) for size, cells in data["budget"].items()]


def _plot_budget_size(data: Json, size: str, cells: Json, outdir: Path) -> Path:
    labels = [label for label, budget in cells.items() if budget and budget["pair"]]
    categories = data["config"]["categories"]
    fig, ax = plt.subplots(figsize=_SIZE)
    positions = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for category in categories:
        # A negative wait (both ran at once for longer than neither did) draws nothing.
        heights = np.array([max(cells[label]["pair"][category], 0.0) for label in labels])
        ax.bar(positions, heights, 0.6, bottom=bottom, label=category)
        bottom += heights
    reference = [cells[label]["reference_us"] for label in labels]
    ax.hlines(reference, positions - 0.3, positions + 0.3, color="black", linewidth=2,
              zorder=3, label="round trip without profiler")
    serialization = data["serialization"][size]["per_round_trip_us"]
    ax.axhline(serialization, color="dimgray", linestyle="--", linewidth=1,
               label="serialization, timed in-process")
    ax.set_xticks(positions, [label.replace("-", "\n", 1) for label in labels])
    ax.set_ylabel("us per round trip (client + server)")
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="upper left",  # as stacked
              bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    quick = ", --quick: numbers mean nothing" if data["config"]["quick"] else ""
    env = data["environment"]
    ax.set_title(f"Where a {size} ping-pong round trip spends its time\n"
                 f"py-spy samples of both processes, {data['config']['rounds']} round(s) pooled, "
                 f"{env['cpu_count']} CPUs, load {env['load_average'][0]:g}{quick}", fontsize=10)
    fig.set_dpi(_DPI)
    return _save(fig, data, outdir, f"budget-{size}.png")


PLOTTERS: dict[str, Callable[[Json, Path], list[Path]]] = {
    "comm": plot_comm,
    "variants": plot_variants,
    "dask": plot_dask,
    "budget": plot_budget,
}


def plot(data: Json, outdir: Path) -> list[Path]:
    """Draw a saved run's figures into ``outdir``; their paths."""
    outdir.mkdir(parents=True, exist_ok=True)
    return PLOTTERS[data["command"]](data, outdir)
