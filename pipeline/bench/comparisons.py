"""Side-by-side ratios of one run's measurements: llmpipe against the peers it ran beside, and speculative
decoding on against off.

A ratio of two measurements from the same run carries over between machines better than either number
(the machines are noisy). Measurements are a flat `{key: value}` map; keys read
`<system>.<precision>[.<path>].<metric>`, e.g. `llamacpp.q8_0.single_decode_tok_s`. When a comparison
names several keys on one side, the best (largest) measured one is used: "any of our precisions against
the best peer".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.bench.load import RunResult

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
class Comparison:
    key: str
    description: str
    numerator: tuple[str, ...]  # measurement keys; the largest measured one is used
    denominator: tuple[str, ...]


@dataclass(frozen=True)
class Ratio:
    comparison: Comparison
    value: float | None  # None when either side was not measured
    numerator_key: str | None
    numerator: float | None
    denominator_key: str | None
    denominator: float | None
    missing: tuple[str, ...]  # keys that were not measured

    def row(self) -> dict[str, object]:
        c = self.comparison
        return {
            "comparison": c.key,
            "description": c.description,
            "ratio": None if self.value is None else round(self.value, 3),
            "numerator": self.numerator_key,
            "numerator_value": self.numerator,
            "denominator": self.denominator_key,
            "denominator_value": self.denominator,
        }


PEER_COMPARISONS: tuple[Comparison, ...] = (
    Comparison(
        "fp32_single_vs_llamacpp_f32",
        "single-request decode, fp32 vs llama.cpp f32",
        ("llmpipe.fp32.single_decode_tok_s",),
        ("llamacpp.f32.single_decode_tok_s",),
    ),
    Comparison(
        "int8_single_vs_llamacpp_q8_0",
        "single-request decode, int8 vs llama.cpp Q8_0",
        ("llmpipe.int8.single_decode_tok_s",),
        ("llamacpp.q8_0.single_decode_tok_s",),
    ),
    Comparison(
        "int4_single_vs_llamacpp_q4_1",
        "single-request decode, int4 vs llama.cpp Q4_1",
        ("llmpipe.int4.single_decode_tok_s",),
        ("llamacpp.q4_1.single_decode_tok_s",),
    ),
    Comparison(
        "single_vs_hf",
        "single-request decode, fp32 vs HF transformers fp32",
        ("llmpipe.fp32.single_decode_tok_s",),
        ("hf.fp32.single_decode_tok_s",),
    ),
    Comparison(
        "served_c16_vs_hf_static",
        "16 concurrent through Triton vs HF static batching",
        tuple(f"llmpipe.{p}.triton.c16_tok_s" for p in OURS),
        ("hf.fp32.c16_tok_s",),
    ),
    Comparison(
        "served_c16_vs_best_peer",
        "16 concurrent through Triton vs the best batched peer",
        tuple(f"llmpipe.{p}.triton.c16_tok_s" for p in OURS),
        PEER_BATCHED,
    ),
)


def _spec_pair(workload: str, mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(speculation on, off) single-request decode keys of an in-process `--speculation none,MODE` run."""
    on = tuple(f"llmpipe.{p}.inprocess.{workload}.{mode}.single_decode_tok_s" for p in OURS)
    off = tuple(f"llmpipe.{p}.inprocess.{workload}.none.single_decode_tok_s" for p in OURS)
    return on, off


SPECULATION_COMPARISONS: tuple[Comparison, ...] = (
    Comparison(
        "prompt_lookup_on_input_copying",
        "single-request decode with prompt lookup vs without, code-edit workload",
        *_spec_pair("code-edit", "ngram"),
    ),
    Comparison(
        "prompt_lookup_when_drafts_are_rejected",
        "single-request decode with prompt lookup vs without, builtin chat prompts",
        *_spec_pair("builtin", "ngram"),
    ),
)


def _best(keys: Sequence[str], measurements: Mapping[str, float]) -> tuple[str | None, float | None]:
    found = [(measurements[k], k) for k in keys if measurements.get(k) is not None]
    if not found:
        return None, None
    value, key = max(found)
    return key, value


def compare(comparisons: Sequence[Comparison], measurements: Mapping[str, float]) -> list[Ratio]:
    ratios = []
    for c in comparisons:
        num_key, num = _best(c.numerator, measurements)
        den_key, den = _best(c.denominator, measurements)
        missing = tuple(k for k in (*c.numerator, *c.denominator) if measurements.get(k) is None)
        value = None if num is None or den is None or den == 0 else num / den
        ratios.append(Ratio(c, value, num_key, num, den_key, den, missing))
    return ratios


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
