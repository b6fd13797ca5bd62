"""Benchmark output: a progress bar while running, a terminal table, results.json + CSV, markdown, PNG plots."""

from __future__ import annotations

import csv
import io
import json
import platform
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.bench.comparisons import Ratio
from pipeline.bench.load import RunResult
from pipeline.bench.metrics import Distribution, RequestRecord, e2e_latency, ttft
from pipeline.errors import MissingArtifactError

# (column, header) of the summary table; latencies in ms except e2e in s
COLUMNS: tuple[tuple[str, str], ...] = (
    ("system", "system"),
    ("load", "load"),
    ("ok", "ok"),
    ("err", "err"),
    ("out_tok_s", "out tok/s"),
    ("req_s", "req/s"),
    ("ttft_mean_ms", "TTFT mean"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p95_ms", "TTFT p95"),
    ("ttft_p99_ms", "TTFT p99"),
    ("itl_mean_ms", "ITL mean"),
    ("itl_p95_ms", "ITL p95"),
    ("tpot_mean_ms", "TPOT mean"),
    ("e2e_mean_s", "e2e mean s"),
    ("e2e_p99_s", "e2e p99 s"),
)
# Shown when some run speculated: decode speed per request, acceptance rate, accepted drafts per step.
SPEC_COLUMNS: tuple[tuple[str, str], ...] = (
    ("decode_tok_s_per_user", "decode tok/s/req"),
    ("acceptance_rate", "accept rate"),
    ("accepted_tokens_per_step", "accepted/step"),
)


def columns_for(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]] = COLUMNS
) -> list[tuple[str, str]]:
    """`columns`, plus those of SPEC_COLUMNS it lacks when any row has an acceptance rate."""
    if not any(row.get("acceptance_rate") is not None for row in rows):
        return list(columns)
    present = {key for key, _ in columns}
    return [*columns, *(c for c in SPEC_COLUMNS if c[0] not in present)]


class ProgressBar:
    """A tqdm bar on stderr that counts finished requests and shows errors; use as the load generator's
    `on_record` callback."""

    def __init__(self, total: int, description: str, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.errors = 0
        self.bar = tqdm(
            total=total, desc=description, unit="req", file=sys.stderr, disable=not enabled, leave=False
        )

    def __call__(self, record: RequestRecord) -> None:
        if not record.ok:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors)
        self.bar.update(1)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.bar.close()


def load_label(result: RunResult) -> str:
    if result.mode == "open":
        cap = f", cap {result.concurrency}" if result.concurrency else ""
        return f"rate {result.request_rate:g}/s{cap}"
    if result.mode == "static-batch":
        return f"batch {result.concurrency}"
    return f"c={result.concurrency}"


def _ms(dist: Distribution | None, field: str) -> float | None:
    return None if dist is None else getattr(dist, field) * 1000.0


def summary_row(result: RunResult) -> dict[str, Any]:
    m = result.metrics()
    return {
        "system": result.system,
        "mode": result.mode,
        "concurrency": result.concurrency,
        "request_rate": result.request_rate,
        "load": load_label(result),
        "ok": m.num_completed,
        "err": m.num_errors,
        "short": m.num_short_outputs,
        "duration_s": m.duration_s,
        "out_tok_s": m.output_tok_s,
        "req_s": m.request_s,
        "decode_tok_s_per_user": m.decode_tok_s_per_user,
        "acceptance_rate": m.acceptance_rate,
        "accepted_tokens_per_step": m.accepted_tokens_per_step,
        **{f"ttft_{f}_ms": _ms(m.ttft_s, f) for f in ("mean", "p50", "p90", "p95", "p99")},
        **{f"itl_{f}_ms": _ms(m.itl_s, f) for f in ("mean", "p50", "p90", "p95", "p99")},
        **{f"tpot_{f}_ms": _ms(m.tpot_s, f) for f in ("mean", "p50", "p95", "p99")},
        **{
            f"e2e_{f}_s": None if m.e2e_s is None else getattr(m.e2e_s, f)
            for f in ("mean", "p50", "p95", "p99")
        },
        **{k: v for k, v in result.extra.items() if isinstance(v, (str, int, float, bool))},
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A fixed-width text table; numbers right-aligned."""
    header = [h for _, h in columns]
    body = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


RATIO_COLUMNS = (
    ("description", "comparison"),
    ("ratio", "ratio"),
    ("numerator_value", "ours"),
    ("denominator_value", "baseline"),
    ("denominator", "baseline key"),
)


def ratio_table(ratios: Sequence[Ratio]) -> str:
    return format_table([r.row() for r in ratios], RATIO_COLUMNS)


def load_1m() -> float | None:
    """The 1-minute load average when a run starts: the noise other processes added (cores = ceiling)."""
    import os

    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_facts() -> dict[str, Any]:
    import os

    import torch

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _compact_records(result: RunResult) -> list[dict[str, Any]]:
    return [
        {
            "index": r.index,
            "input_tokens": r.num_input_tokens,
            "output_tokens": r.num_output_tokens,
            "ttft_s": ttft(r),
            "e2e_s": e2e_latency(r),
            "error": r.error,
        }
        for r in result.records
    ]


def write_results(
    out_dir: Path,
    results: Sequence[RunResult],
    meta: dict[str, Any] | None = None,
    measurements: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> list[Path]:
    """results.json (summaries, measurements, per-request records, then `extra`'s entries) and
    results.csv (one row per run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [summary_row(r) for r in results]
    data = {
        "meta": {**machine_facts(), **(meta or {})},
        "runs": [
            {**row, "metrics": r.metrics().to_dict(), "requests": _compact_records(r)}
            for row, r in zip(rows, results, strict=True)
        ],
        "measurements": measurements or {},
        **(extra or {}),
    }
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    csv_path = out_dir / "results.csv"
    buffer = io.StringIO()
    keys = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buffer, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    csv_path.write_text(buffer.getvalue())
    return [json_path, csv_path]


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (no display)."""
    try:
        import matplotlib
    except ImportError:
        raise MissingArtifactError(
            "matplotlib is not installed: the plots cannot be drawn (results.json/CSV were written)",
            hint="make bench-deps (or pip install matplotlib), or pass --no-plots",
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(out_dir: Path, results: Sequence[RunResult]) -> list[Path]:
    """Throughput vs concurrency, TTFT/ITL percentiles vs concurrency, and the e2e latency CDF."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    closed = [r for r in results if r.mode in ("closed", "static-batch") and r.concurrency]
    by_system: dict[str, list[RunResult]] = {}
    for r in closed:
        by_system.setdefault(r.system, []).append(r)
    paths = []

    colors = {system: f"C{i % 10}" for i, system in enumerate(by_system)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, runs in by_system.items():
        runs = sorted(runs, key=lambda r: r.concurrency or 0)
        xs = [r.concurrency or 0 for r in runs]
        ax.plot(xs, [r.metrics().output_tok_s for r in runs], marker="o", color=colors[system], label=system)
    finish_axes(
        ax, "concurrency (batch size for static batches)", "output tokens/s", "Throughput vs concurrency"
    )
    concurrency_axis(ax, closed)
    paths.append(save_figure(fig, out_dir / "throughput_vs_concurrency.png"))

    # one colour per system, one line style per percentile
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "ITL")):
        for system, runs in by_system.items():
            dists = [(r.concurrency or 0, getattr(r.metrics(), metric)) for r in runs]
            dists = sorted(((c, d) for c, d in dists if d is not None), key=lambda item: item[0])
            for pct, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                if dists:
                    ys = [getattr(d, pct) * 1000 for _, d in dists]
                    ax.plot(
                        [c for c, _ in dists],
                        ys,
                        style,
                        marker="o",
                        color=colors[system],
                        label=f"{system} {pct}",
                    )
        finish_axes(ax, "concurrency", f"{title} (ms)", f"{title} percentiles vs concurrency")
        concurrency_axis(ax, closed)
        ax.set_yscale("log")
    paths.append(save_figure(fig, out_dir / "latency_percentiles_vs_concurrency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        values = sorted(e2e_latency(rec) for rec in r.records if rec.ok)
        if values:
            ax.step(
                values,
                [(i + 1) / len(values) for i in range(len(values))],
                where="post",
                label=f"{r.system} {load_label(r)}",
            )
    finish_axes(ax, "end-to-end latency (s)", "fraction of requests", "Latency CDF")
    paths.append(save_figure(fig, out_dir / "latency_cdf.png"))
    return paths


def concurrency_axis(ax: Any, runs: Sequence[RunResult]) -> None:
    """Log-2 spacing (sweeps double), labelled with the concurrencies actually run."""
    ticks = sorted({r.concurrency for r in runs if r.concurrency})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def finish_axes(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save_figure(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


MARKDOWN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("system", "system"),
    ("load", "load"),
    ("ok", "requests"),
    ("out_tok_s", "output tok/s"),
    ("decode_tok_s_per_user", "decode tok/s per request"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("ttft_p95_ms", "TTFT p95 ms"),
    ("itl_mean_ms", "ITL mean ms"),
    ("itl_p95_ms", "ITL p95 ms"),
    ("e2e_mean_s", "e2e mean s"),
    ("load_1m", "load avg"),
)


def markdown_document(
    title: str,
    command: str,
    notes: Sequence[str],
    results: Sequence[RunResult],
    sections: Sequence[str] = (),
    plot_links: Sequence[str] = (),
) -> str:
    """A results page: how it was run, on what, the runs table, further markdown `sections`, the plots
    (links relative to the page)."""
    facts = machine_facts()
    rows = [summary_row(r) for r in results]
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {facts['cpus']} CPUs, {facts['platform']}, Python {facts['python']}, torch {facts['torch']} "
        f"({facts['torch_threads']} threads); load average at the end {facts['load_average']}.",
        "",
        *notes,
        "",
        markdown_table(rows, columns_for(rows, MARKDOWN_COLUMNS)),
    ]
    for section in sections:
        lines += ["", section]
    if plot_links:
        lines += ["", *(f"![{Path(link).stem}]({link})" for link in plot_links)]
    return "\n".join(lines) + "\n"


def machine_tag() -> str:
    """A short, stable name for results files: `<cpus>cpu-<arch>`, plus the GPU when there is one."""
    import os

    import torch

    tag = f"{os.cpu_count()}cpu-{platform.machine()}"
    if torch.cuda.is_available():
        tag += "-" + torch.cuda.get_device_name(0).replace(" ", "_").lower()
    return tag
