"""The speed goals our benchmark scripts check: each one a side-by-side ratio within one run and the
bound it should reach, marked met, missed or not measured. They are ours, so they live beside the
scripts, not in the package: `llmpipe bench` reports the same ratios without judging them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeline.bench import report
from pipeline.bench.comparisons import (
    OURS,
    PEER_COMPARISONS,
    SPECULATION_COMPARISONS,
    Comparison,
    Ratio,
    compare,
    precision_comparisons,
)

Status = Literal["met", "missed", "not measured"]
_PEER = {c.key: c for c in PEER_COMPARISONS}
_SPECULATION = {c.key: c for c in SPECULATION_COMPARISONS}


@dataclass(frozen=True)
class SpeedTarget:
    comparison: Comparison
    op: Literal[">=", "<="]
    ratio: float


@dataclass(frozen=True)
class Verdict:
    target: SpeedTarget
    status: Status
    measured: Ratio

    def row(self) -> dict[str, object]:
        t, m = self.target, self.measured
        return {
            "target": t.comparison.key,
            "description": t.comparison.description,
            "goal": f"{t.op} {t.ratio:g}x",
            "measured": None if m.value is None else round(m.value, 3),
            "numerator": m.numerator_key,
            "numerator_value": m.numerator,
            "denominator": m.denominator_key,
            "denominator_value": m.denominator,
            "status": self.status,
        }


# scripts/bench_engine.py: the engine against Hugging Face `generate` on the same requests
ENGINE_TARGETS: tuple[SpeedTarget, ...] = (
    SpeedTarget(
        Comparison(
            "engine_vs_hf_static_batch",
            "engine output tok/s vs HF padded static batch",
            ("engine.fp32.output_tok_s",),
            ("hf.fp32.static_batch.output_tok_s",),
        ),
        ">=",
        3.0,
    ),
    SpeedTarget(
        Comparison(
            "engine_vs_hf_one_at_a_time",
            "engine output tok/s vs HF one request at a time",
            ("engine.fp32.output_tok_s",),
            ("hf.fp32.single.output_tok_s",),
        ),
        ">=",
        8.0,
    ),
    SpeedTarget(
        Comparison(
            "engine_single_decode_vs_hf",
            "single-request decode vs HF's",
            ("engine.fp32.single_decode_tok_s",),
            ("hf.fp32.single_decode_tok_s",),
        ),
        ">=",
        0.9,
    ),
)

# scripts/bench_peers.py (`make bench`): llmpipe beside llama.cpp, CTranslate2, OpenVINO GenAI and HF; per
# precision, ahead of the best peer at that precision, served close to in-process, and single-request
# decode close to what the memory bandwidth allows
# comparison key after "<precision>_" -> goal
PER_PRECISION_GOALS: dict[str, tuple[Literal[">=", "<="], float]] = {
    "single_vs_best_peer": (">=", 1.2),
    "c16_vs_best_peer": (">=", 1.2),
    "served_vs_inprocess_c16": (">=", 0.9),
    "single_vs_bandwidth_limit": (">=", 0.6),
}
PEER_TARGETS: tuple[SpeedTarget, ...] = (
    *(
        SpeedTarget(c, *PER_PRECISION_GOALS[c.key.removeprefix(f"{precision}_")])
        for precision in OURS
        for c in precision_comparisons(precision)
    ),
    SpeedTarget(_PEER["single_vs_hf"], ">=", 2.0),
    SpeedTarget(_PEER["served_c16_vs_hf_static"], ">=", 3.0),
    SpeedTarget(_PEER["served_c16_vs_best_peer"], ">=", 1.3),
    SpeedTarget(
        Comparison(
            "ttft_p95_c16_vs_single",
            "TTFT p95 at concurrency 16 (steady state) vs single-request TTFT, 256-token prompts",
            ("llmpipe.fp32.ttft_p95_c16_prompt256_s",),
            ("llmpipe.fp32.ttft_mean_c1_prompt256_s",),
        ),
        "<=",
        3.0,
    ),
)

# scripts/bench_spec.py: prompt lookup must pay off where answers copy the prompt, and cost little where
# its drafts are rejected
SPECULATION_TARGETS: tuple[SpeedTarget, ...] = (
    SpeedTarget(_SPECULATION["prompt_lookup_on_input_copying"], ">=", 1.5),
    SpeedTarget(_SPECULATION["prompt_lookup_when_drafts_are_rejected"], ">=", 0.95),
)


def check(targets: Sequence[SpeedTarget], measurements: Mapping[str, float]) -> list[Verdict]:
    ratios = compare([t.comparison for t in targets], measurements)
    return [Verdict(t, _status(t, r), r) for t, r in zip(targets, ratios, strict=True)]


def _status(target: SpeedTarget, measured: Ratio) -> Status:
    if measured.value is None:
        return "not measured"
    met = measured.value >= target.ratio if target.op == ">=" else measured.value <= target.ratio
    return "met" if met else "missed"


COLUMNS = (
    ("description", "target"),
    ("goal", "goal"),
    ("measured", "measured"),
    ("numerator_value", "ours"),
    ("denominator_value", "baseline"),
    ("denominator", "baseline key"),
    ("status", "status"),
)


def table(verdicts: Sequence[Verdict], markdown: bool = False) -> str:
    rows = [v.row() for v in verdicts]
    return report.markdown_table(rows, COLUMNS) if markdown else report.format_table(rows, COLUMNS)


def section(verdicts: Sequence[Verdict]) -> str:
    """The targets as a block of a results page (report.markdown_document's `sections`)."""
    return "Targets (ratios within this run):\n\n" + table(verdicts, markdown=True)


def bandwidth_verdicts(verdicts: Sequence[Verdict]) -> dict[str, str]:
    """Per precision, how llmpipe's single-request decode fared against the memory bandwidth limit, as
    the results page's machine header (pipeline.bench.machine.header) shows it."""
    out = {}
    for v in verdicts:
        precision, _, goal = v.target.comparison.key.partition("_")
        m = v.measured
        if goal == "single_vs_bandwidth_limit" and m.value is not None and m.numerator is not None:
            out[precision] = (
                f"llmpipe {m.numerator:.1f} tok/s = {m.value:.0%} of it "
                f"(target {v.target.op} {v.target.ratio:.0%}): {v.status}"
            )
    return out
