"""Figures of ``python -m benchmarks asap``: the cluster's loss against wall
time and against bytes sent, one line per mode, the target as a dashed line;
and, per degree budget of asap's graph, its mixing against what reaching the
target took."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dask_lcicomm.asap.report import RunReport


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_case(case: str, title: str, reports: list[RunReport], offset: float, target: float,
              outdir: Path) -> list[Path]:
    """Two PNGs for one case: ``asap-<case>-loss-time.png`` and ``-loss-bytes.png``;
    the loss is drawn less ``offset`` (``f*`` where it is known, else 0)."""
    plt = _pyplot()
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    axes = (("t", "wall time [s]", 1.0), ("bytes", "bytes sent by all workers [MB]", 1e-6))
    for axis, label, scale in axes:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for report in reports:
            curve = report.curve()
            ax.plot([getattr(p, axis) * scale for p in curve], [p.loss - offset for p in curve],
                    label=f"{report.mode} ({report.graph})", linewidth=1.4)
        ax.axhline(target - offset, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("mean loss of the workers' models" + (" - f*" if offset else ""))
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = outdir / f"asap-{case}-loss-{'time' if axis == 't' else 'bytes'}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_degrees(case: str, records: list[dict[str, Any]], workers: int, model: str,
                 outdir: Path) -> Path:
    """``asap-degrees.png``: per degree budget, rounds and bytes to target
    (a cross where the target was not reached), with the graph's spectral gap
    and diameter under each budget."""
    plt = _pyplot()
    outdir.mkdir(parents=True, exist_ok=True)
    fig, (rounds_ax, bytes_ax) = plt.subplots(1, 2, figsize=(9.6, 4.4), layout="constrained")
    ticks = [f"{r['degree_budget']}\ngap {r['spectral_gap']:.3f}\n"
             f"diam {'inf' if r['diameter'] is None else format(r['diameter'], 'g')}" for r in records]
    slots = list(range(len(records)))
    for ax, key, scale, label in ((rounds_ax, "rounds_to_target", 1.0, "rounds to target"),
                                  (bytes_ax, "bytes_to_target", 1e-6, "MB sent to target")):
        heights = [r[key] * scale if r["reached_target"] else 0.0 for r in records]
        ax.bar(slots, heights, color="tab:blue", width=0.6)
        missed = [i for i, r in zip(slots, records, strict=True) if not r["reached_target"]]
        if missed:
            ax.plot(missed, [0] * len(missed), "x", color="tab:red", markersize=12, clip_on=False,
                    label="not reached")
            ax.legend(fontsize=8)
        ax.set_ylim(bottom=0, top=1.15 * max(heights) if any(heights) else 1.0)
        ax.set_xticks(slots, ticks, fontsize=8)
        ax.set_xlabel("degree budget")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"asap, {model}, {workers} workers, {case} case: the graph's mixing against what "
                 "reaching the target took", fontsize=10)
    path = outdir / "asap-degrees.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
