"""Figures of ``budget``: per payload, one stacked bar per configuration whose
segments are the categories of a round trip (both processes on CPU, then the
wait of neither), so the bar's height is the profiled round trip; a black tick
marks the round trip without the profiler, a dashed line the in-process
serialization cost that every comm pays."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from benchmarks.plots import _DPI, _SIZE, Json, _save

__all__ = ["plot_budget"]


def plot_budget(data: Json, outdir: Path) -> list[Path]:
    """``budget-<size>.png`` per payload size."""
    return [_plot_size(data, size, cells, outdir) for size, cells in data["budget"].items()]


def _plot_size(data: Json, size: str, cells: Json, outdir: Path) -> Path:
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
