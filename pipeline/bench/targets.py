"""The speed targets of issues 3, 7 and 9 as data, and a checker that marks each one met, missed or not measured.

A target compares two measurements from the same run as a ratio (the machines are noisy; ratios within
one run are what carry over). Measurements are a flat `{key: value}` map; keys read
`<system>.<precision>[.<path>].<metric>`, e.g. `llamacpp.q8_0.single_decode_tok_s`. When a target names
several keys on one side, the best (largest) measured one is used: "any of our precisions against the
best peer".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeline.bench.load import RunResult

Status = Literal["met", "missed", "not measured"]
OURS = ("fp32", "bf16", "int8", "int4")
# each peer's batched run with 16 requests in flight (HF: a padded static batch of 16)
PEER_BATCHED = (
    "hf.fp32.c16_tok_s",
    "llamacpp.f32.c16_tok_s",
    "llamacpp.bf16.c16_tok_s",
    "llamacpp.q8_0.c16_tok_s",
    "llamacpp.q4_1.c16_tok_s",
    "ct2.float32.c16_tok_s",
    "ct2.int8.c16_tok_s",
)


@dataclass(frozen=True)
class SpeedTarget:
    key: str
    issue: int
    description: str
    numerator: tuple[str, ...]  # measurement keys; the largest measured one is used
    denominator: tuple[str, ...]
    op: Literal[">=", "<="]
    ratio: float


@dataclass(frozen=True)
class Verdict:
    target: SpeedTarget
    status: Status
    measured_ratio: float | None
    numerator_key: str | None
    numerator: float | None
    denominator_key: str | None
    denominator: float | None
    missing: tuple[str, ...]  # keys that were not measured

    def row(self) -> dict[str, object]:
        t = self.target
        return {
            "target": t.key,
            "issue": t.issue,
            "description": t.description,
            "goal": f"{t.op} {t.ratio:g}x",
            "measured": None if self.measured_ratio is None else round(self.measured_ratio, 3),
            "numerator": self.numerator_key,
            "numerator_value": self.numerator,
            "denominator": self.denominator_key,
            "denominator_value": self.denominator,
            "status": self.status,
        }


ISSUE3_TARGETS: tuple[SpeedTarget, ...] = (
    SpeedTarget(
        "engine_vs_hf_static_batch",
        3,
        "engine output tok/s >= 3x HF padded static batch",
        ("engine.fp32.output_tok_s",),
        ("hf.fp32.static_batch.output_tok_s",),
        ">=",
        3.0,
    ),
    SpeedTarget(
        "engine_vs_hf_one_at_a_time",
        3,
        "engine output tok/s >= 8x HF one request at a time",
        ("engine.fp32.output_tok_s",),
        ("hf.fp32.single.output_tok_s",),
        ">=",
        8.0,
    ),
    SpeedTarget(
        "engine_single_decode_vs_hf",
        3,
        "single-request decode >= 0.9x HF's",
        ("engine.fp32.single_decode_tok_s",),
        ("hf.fp32.single_decode_tok_s",),
        ">=",
        0.9,
    ),
)

ISSUE7_TARGETS: tuple[SpeedTarget, ...] = (
    SpeedTarget(
        "fp32_single_vs_llamacpp_f32",
        7,
        "single-request decode fp32 >= 0.8x llama.cpp f32",
        ("llmpipe.fp32.single_decode_tok_s",),
        ("llamacpp.f32.single_decode_tok_s",),
        ">=",
        0.8,
    ),
    SpeedTarget(
        "int8_single_vs_llamacpp_q8_0",
        7,
        "single-request decode int8 >= 0.8x llama.cpp Q8_0",
        ("llmpipe.int8.single_decode_tok_s",),
        ("llamacpp.q8_0.single_decode_tok_s",),
        ">=",
        0.8,
    ),
    SpeedTarget(
        "int4_single_vs_llamacpp_q4_1",
        7,
        "single-request decode int4 >= 0.8x llama.cpp Q4_1",
        ("llmpipe.int4.single_decode_tok_s",),
        ("llamacpp.q4_1.single_decode_tok_s",),
        ">=",
        0.8,
    ),
    SpeedTarget(
        "single_vs_hf",
        7,
        "single-request decode (fp32) >= 2x HF transformers fp32",
        ("llmpipe.fp32.single_decode_tok_s",),
        ("hf.fp32.single_decode_tok_s",),
        ">=",
        2.0,
    ),
    SpeedTarget(
        "served_c16_vs_hf_static",
        7,
        "16 concurrent through Triton >= 3x HF static batching",
        tuple(f"llmpipe.{p}.triton.c16_tok_s" for p in OURS),
        ("hf.fp32.c16_tok_s",),
        ">=",
        3.0,
    ),
    SpeedTarget(
        "served_c16_vs_best_peer",
        7,
        "16 concurrent through Triton >= 1.3x the best batched peer",
        tuple(f"llmpipe.{p}.triton.c16_tok_s" for p in OURS),
        PEER_BATCHED,
        ">=",
        1.3,
    ),
    SpeedTarget(
        "served_vs_inprocess_c16",
        7,
        "served throughput >= 90% of in-process at concurrency 16 (fp32)",
        ("llmpipe.fp32.triton.c16_tok_s",),
        ("llmpipe.fp32.inprocess.c16_tok_s",),
        ">=",
        0.9,
    ),
    SpeedTarget(
        "ttft_p95_c16_vs_single",
        7,
        "TTFT p95 at concurrency 16 (steady state) <= 3x single-request TTFT, 256-token prompts",
        ("llmpipe.fp32.ttft_p95_c16_prompt256_s",),
        ("llmpipe.fp32.ttft_mean_c1_prompt256_s",),
        "<=",
        3.0,
    ),
)


def _spec_pair(workload: str, mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(speculation on, off) single-request decode keys of an in-process `--speculation none,MODE` run."""
    on = tuple(f"llmpipe.{p}.inprocess.{workload}.{mode}.single_decode_tok_s" for p in OURS)
    off = tuple(f"llmpipe.{p}.inprocess.{workload}.none.single_decode_tok_s" for p in OURS)
    return on, off


ISSUE9_TARGETS: tuple[SpeedTarget, ...] = (
    SpeedTarget(
        "prompt_lookup_on_input_copying",
        9,
        "single-request decode with prompt lookup >= 1.5x without, code-edit workload",
        *_spec_pair("code-edit", "ngram"),
        ">=",
        1.5,
    ),
    SpeedTarget(
        "prompt_lookup_when_drafts_are_rejected",
        9,
        "single-request decode with prompt lookup >= 0.95x without, builtin chat prompts",
        *_spec_pair("builtin", "ngram"),
        ">=",
        0.95,
    ),
)


def _best(keys: Sequence[str], measurements: Mapping[str, float]) -> tuple[str | None, float | None]:
    found = [(measurements[k], k) for k in keys if measurements.get(k) is not None]
    if not found:
        return None, None
    value, key = max(found)
    return key, value


def check(targets: Sequence[SpeedTarget], measurements: Mapping[str, float]) -> list[Verdict]:
    verdicts = []
    for t in targets:
        num_key, num = _best(t.numerator, measurements)
        den_key, den = _best(t.denominator, measurements)
        missing = tuple(k for k in (*t.numerator, *t.denominator) if measurements.get(k) is None)
        if num is None or den is None or den == 0:
            verdicts.append(Verdict(t, "not measured", None, num_key, num, den_key, den, missing))
            continue
        ratio = num / den
        met = ratio >= t.ratio if t.op == ">=" else ratio <= t.ratio
        verdicts.append(Verdict(t, "met" if met else "missed", ratio, num_key, num, den_key, den, missing))
    return verdicts


def measurements(results: Sequence[RunResult]) -> dict[str, float]:
    """Measurement keys of closed-loop and batched runs whose `extra` names `engine` and `precision`
    (and `path` for llmpipe: inprocess | triton; `workload` for a side workload; `speculation` for a run
    of a `--speculation` sweep): `c{N}_tok_s`, `c{N}_ttft_mean_s`, `c{N}_ttft_p95_s`,
    `c{N}_acceptance_rate`, `c{N}_accepted_tokens_per_step`, and `single_decode_tok_s` from the
    concurrency-1 run. A path-less llmpipe single-decode key takes the in-process value when there is one
    (the engine's speed, without transport); side workloads never set it."""
    out: dict[str, float] = {}
    for r in results:
        engine, precision, path = r.extra.get("engine"), r.extra.get("precision"), r.extra.get("path")
        workload, speculation = r.extra.get("workload"), r.extra.get("speculation")
        if r.mode == "open" or not engine or not precision or not r.concurrency:
            continue
        m = r.metrics()
        if m.num_completed == 0:
            continue
        base = ".".join(str(p) for p in (engine, precision, path, workload, speculation) if p)
        out[f"{base}.c{r.concurrency}_tok_s"] = m.output_tok_s
        if m.ttft_s is not None:
            out[f"{base}.c{r.concurrency}_ttft_mean_s"] = m.ttft_s.mean
            out[f"{base}.c{r.concurrency}_ttft_p95_s"] = m.ttft_s.p95
        if m.acceptance_rate is not None:
            out[f"{base}.c{r.concurrency}_acceptance_rate"] = m.acceptance_rate
        if m.accepted_tokens_per_step is not None:
            out[f"{base}.c{r.concurrency}_accepted_tokens_per_step"] = m.accepted_tokens_per_step
        if r.concurrency == 1 and m.decode_tok_s_per_user is not None:
            out[f"{base}.single_decode_tok_s"] = m.decode_tok_s_per_user
            plain = f"{engine}.{precision}.single_decode_tok_s"
            if path and not workload and (path == "inprocess" or plain not in out):
                out[plain] = m.decode_tok_s_per_user
    return out
