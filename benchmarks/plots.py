"""Figures of a run, drawn from its JSON so that a saved run can be drawn again;
every round shows, for a reader to see how much of a difference is noise."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none wanted

import matplotlib.pyplot as plt  # after choosing the backend
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter

Json = Mapping[str, Any]

_SIZE = (7.5, 4.5)
_DPI = 110


def _title(data: Json, what: str) -> str:
    env, config = data["environment"], data["config"]
    quick = ", --quick: numbers mean nothing" if config["quick"] else ""
    return (f"{what}\n{config['rounds']} round(s), {env['cpu_count']} CPUs, load "
            f"{env['load_average'][0]:g} at the start, distributed {env['distributed']}{quick}")


def _save(fig: Any, data: Json, path: Path) -> Path:
    missing = [f"{label}: {s['label']}" for label, s in data["status"].items() if not s["available"]]
    if missing:
        fig.text(0.01, 0.01, "not measured: " + "; ".join(missing), fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03 if missing else 0, 1, 1))
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _ratios(result: Json, label: str, baseline: str) -> tuple[float, list[float]]:
    """``label``'s median and rounds over ``baseline``'s median, >1 better either way."""
    base = result["per_configuration"][baseline]["median"]
    numbers = result["per_configuration"][label]

    def ratio(value: float | None) -> float:
        if not value or not base:
            return np.nan  # no bar, no dot
        return value / base if result["higher_is_better"] else base / value

    return ratio(numbers["median"]), [ratio(value) for value in numbers["rounds"]]


def _plot_ratios(data: Json, outdir: Path) -> list[Path]:
    """Every benchmark's headline metric (its first), a panel per kind: a bar from 1 to each
    configuration's median over the baseline's (the first ratio's divisor), a dot per round."""
    labels = [label for label, status in data["status"].items() if status["available"]]
    ratios = data["config"]["ratios"]
    panels: dict[str, dict[str, Json]] = {}
    for result in data["results"]:
        kind = result.get("kind") or result["benchmark"].split("-")[0]  # dask: bulk, compute
        panels.setdefault(kind, {}).setdefault(result["benchmark"], result)
    if not labels or not panels:
        return []
    baseline = ratios[0].split("/")[1] if ratios else labels[0]
    bars = len(labels) * sum(map(len, panels.values()))
    fig, axes = plt.subplots(1, len(panels), sharey=True, squeeze=False,
                             width_ratios=[len(results) for results in panels.values()],
                             figsize=(min(max(_SIZE[0], 3 + 0.12 * bars), 18), _SIZE[1]))
    colors = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    width = 0.8 / len(labels)
    for ax, (kind, results) in zip(axes[0], panels.items(), strict=True):
        for i, label in enumerate(labels):
            x = np.arange(len(results)) + (i - (len(labels) - 1) / 2) * width
            spreads = [_ratios(result, label, baseline) for result in results.values()]
            # Bars grow from 1 (as good as the baseline) towards the ratio, down when worse.
            ax.bar(x, [median - 1 for median, _ in spreads], width, bottom=1.0,
                   color=colors(i % colors.N), label=label)
            for position, (_, rounds) in zip(x, spreads, strict=True):
                ax.plot([position] * len(rounds), rounds, ".", color="black", markersize=3)
        ax.set_xticks(range(len(results)), [name.removeprefix(f"{kind}-") for name in results],
                      rotation=30, ha="right")
        ax.set_title(kind, fontsize=9)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    first = axes[0][0]
    first.set_yscale("log", base=2)
    bottom, top = first.get_ylim()
    first.set_ylim(min(bottom, 0.5), max(top, 2.0))  # so that noise does not fill the panel
    first.yaxis.set_major_locator(FixedLocator([0.75, 1.5, *(2.0**k for k in range(-10, 11))]))
    first.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
    first.set_ylabel(f"ratio to {baseline}'s median (>1 is better)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(_title(data, f"{data['command']}: bars are medians, dots rounds"), fontsize=10)
    return [_save(fig, data, outdir / f"{data['command']}.png")]


def _plot_budget(data: Json, size: str, cells: Json, outdir: Path) -> Path:
    """A stacked bar of a round trip's categories per configuration, a tick for the
    unprofiled round trip, a line for serialization alone."""
    labels = [label for label, budget in cells.items() if budget and budget["pair"]]
    fig, ax = plt.subplots(figsize=_SIZE)
    positions = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for category in data["config"]["categories"]:
        # A negative wait (both ran at once for longer than neither did) draws nothing.
        heights = np.array([max(cells[label]["pair"][category], 0.0) for label in labels])
        ax.bar(positions, heights, 0.6, bottom=bottom, label=category)
        bottom += heights
    ax.hlines([cells[label]["reference_us"] for label in labels], positions - 0.3,
              positions + 0.3, color="black", linewidth=2, zorder=3,
              label="round trip without profiler")
    ax.axhline(data["serialization"][size]["per_round_trip_us"], color="dimgray",
               linestyle="--", linewidth=1, label="serialization, timed in-process")
    ax.set_xticks(positions, [label.replace("-", "\n", 1) for label in labels])
    ax.set_ylabel("us per round trip (client + server)")
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="upper left",  # as stacked
              bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(_title(data, f"Where a {size} round trip spends its time (py-spy, pooled)"),
                 fontsize=10)
    return _save(fig, data, outdir / f"budget-{size}.png")


def plot(data: Json, outdir: Path) -> list[Path]:
    """Draw a saved run's figures into ``outdir``; their paths."""
    outdir.mkdir(parents=True, exist_ok=True)
    if data["command"] == "budget":
        return [_plot_budget(data, size, cells, outdir) for size, cells in data["budget"].items()]
    return _plot_ratios(data, outdir)
