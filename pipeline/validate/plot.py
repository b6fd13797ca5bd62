"""validation.png: one panel per gated metric, one bar per build (mode), its bound drawn across the bar."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError

PASS_COLOR, FAIL_COLOR = "#4c9a4c", "#c0392b"


def plot_reports(reports: list[dict[str, Any]], path: Path) -> Path:
    """Write the chart of these validation reports to `path`; returns it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on build machines
        import matplotlib.pyplot as plt
    except ImportError:
        raise PipelineError("--plot needs matplotlib", hint="pip install matplotlib") from None
    metrics = [row["metric"] for row in reports[0]["gates"]]
    labels = [f"{r['build']}\n{r['profile']}" for r in reports]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        rows = [next(row for row in r["gates"] if row["metric"] == metric) for r in reports]
        values = [row["value"] if row["value"] is not None else 0.0 for row in rows]
        colors = [FAIL_COLOR if row["status"] == "fail" else PASS_COLOR for row in rows]
        positions = list(range(len(rows)))
        ax.bar(positions, values, color=colors, width=0.6)
        for x, row in zip(positions, rows, strict=True):
            bounds = [row["threshold"], -row["threshold"]] if row["op"] == "|x|<=" else [row["threshold"]]
            ax.hlines(bounds, x - 0.4, x + 0.4, colors="black", linestyles="dashed", linewidth=1)
            if row["value"] is None:
                ax.text(x, 0, "skipped", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_title(f"{metric} ({rows[0]['op']} bound)", fontsize=9)
        ax.set_xticks(positions, labels, fontsize=7, rotation=30, ha="right")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("llmpipe validate: engine vs float32 HF reference (dashed: bound; red: failed)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
