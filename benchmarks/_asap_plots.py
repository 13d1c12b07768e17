"""Figures of ``python -m benchmarks asap``: the cluster's loss against wall
time and against bytes sent, one line per mode, the target as a dashed line."""

from __future__ import annotations

from pathlib import Path

from dask_lcicomm.asap.report import RunReport


def plot_case(case: str, title: str, reports: list[RunReport], f_star: float, target: float,
              outdir: Path) -> list[Path]:
    """Two PNGs for one case: ``asap-<case>-loss-time.png`` and ``-loss-bytes.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    axes = (("t", "wall time [s]", 1.0), ("bytes", "bytes sent by all workers [MB]", 1e-6))
    for axis, label, scale in axes:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for report in reports:
            curve = report.curve()
            ax.plot([getattr(p, axis) * scale for p in curve], [p.loss - f_star for p in curve],
                    label=f"{report.mode} ({report.graph})", linewidth=1.4)
        ax.axhline(target - f_star, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("mean loss of the workers' models - f*")
        ax.set_title(f"logistic regression, {len(reports[0].workers)} workers: {title}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = outdir / f"asap-{case}-loss-{'time' if axis == 't' else 'bytes'}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
