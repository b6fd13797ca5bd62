"""validation.json: the gates applied to the measured metrics, the verdict, and a printable table."""

from __future__ import annotations

from typing import Any

from pipeline.errors import AccuracyRegression
from pipeline.validate.measure import Measurement
from pipeline.validate.thresholds import Gate

REPORT_FILE = "validation.json"
PLOT_FILE = "validation.png"

# Reported beside the gates in the table: (metric, label)
INFORMATIONAL = (
    ("ppl_reference", "perplexity, reference"),
    ("ppl_engine", "perplexity, engine"),
    ("rouge1_engine", "ROUGE-1, engine"),
    ("rouge2_engine", "ROUGE-2, engine"),
    ("rougeL_engine", "ROUGE-L, engine"),
    ("rougeL_reference", "ROUGE-L, reference"),
    ("exact_match_engine", "exact match, engine"),
    ("exact_match_reference", "exact match, reference"),
)


def build_report(header: dict[str, Any], gates: list[Gate], measurement: Measurement) -> dict[str, Any]:
    rows = []
    for gate in gates:
        value = measurement.metrics.get(gate.metric)
        row: dict[str, Any] = {
            "metric": gate.metric,
            "op": gate.op,
            "threshold": gate.threshold,
            "field": gate.field,
            "source": gate.source,
            "value": value,
            "count": measurement.counts.get(gate.metric),
        }
        if value is None:
            row["status"] = "skipped"
            row["reason"] = measurement.skipped.get(gate.metric, "not measured")
        else:
            row["status"] = "pass" if gate.passes(value) else "fail"
        rows.append(row)
    return {
        **header,
        "passed": all(r["status"] != "fail" for r in rows),
        "gates": rows,
        "metrics": measurement.metrics,
        "skipped": measurement.skipped,
        "seconds": {k: round(v, 2) for k, v in measurement.seconds.items()},
        "samples": measurement.samples,
    }


def failures(report: dict[str, Any]) -> list[str]:
    """One line per failing gate: metric, value, the bound it broke and where the bound came from."""
    out = []
    for row in report["gates"]:
        if row["status"] == "fail":
            value, bound = _fmt(row["value"]), _fmt(row["threshold"])
            broke = {
                ">=": f"{value} < {bound}",
                "<=": f"{value} > {bound}",
                "|x|<=": f"{value}, |x| > {bound}",
            }
            out.append(
                f"{row['metric']}={broke[row['op']]} (validation.thresholds.{row['field']}, {row['source']})"
            )
    return out


def raise_for_failures(reports: list[tuple[dict[str, Any], str]]) -> None:
    """Raise one AccuracyRegression naming every failing gate of every (report, its path) given."""
    failed = [(report, path) for report, path in reports if not report["passed"]]
    if not failed:
        return
    details = " | ".join(f"{report['build']}: " + "; ".join(failures(report)) for report, _ in failed)
    raise AccuracyRegression(
        f"accuracy regression in {len(failed)} of {len(reports)} build(s) against the reference: {details}",
        hint=f"Per-sample outputs: {', '.join(path for _, path in failed)}. If the loss is expected for this "
        "build, set the bound explicitly, e.g. --set validation.thresholds.max_ppl_delta_pct=2",
    )


def format_table(report: dict[str, Any]) -> list[str]:
    lines = [
        f"validation of {report['build']} ({report['target']}; profile {report['profile']}; "
        f"dataset {report['dataset']}, {report['num_samples']} samples per metric)"
    ]
    lines.append(f"  {'metric':<18} {'value':>11}   {'bound':<15} {'n':>5}  status")
    for row in report["gates"]:
        value = "-" if row["value"] is None else _fmt(row["value"])
        count = "" if row["count"] is None else str(row["count"])
        status = row["status"].upper() if row["status"] == "fail" else row["status"]
        lines.append(
            f"  {row['metric']:<18} {value:>11}   {row['op']:>5} {_fmt(row['threshold']):<9} {count:>5}  "
            f"{status}  [{row['source']}]"
        )
    for metric, label in INFORMATIONAL:
        if metric in report["metrics"]:
            lines.append(f"  {label:<26} {_fmt(report['metrics'][metric]):>11}")
    by_reason: dict[str, list[str]] = {}
    for metric, reason in report["skipped"].items():
        by_reason.setdefault(reason, []).append(metric)
    for reason, metrics in by_reason.items():
        lines.append(f"  skipped {', '.join(metrics)}: {reason}")
    lines.append("PASSED" if report["passed"] else "FAILED: " + "; ".join(failures(report)))
    return lines


def _fmt(value: float) -> str:
    return f"{value:.6g}"
