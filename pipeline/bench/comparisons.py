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

OURS = ("fp32", "bf16", "int8", "w8a8", "int4")
# The peers that run weights of each of our precisions, as measurement key prefixes. Every int8 peer also
# multiplies int8 activations (llama.cpp rounds them to Q8_0 blocks, CTranslate2 per row, OpenVINO's CPU
# plugin per group of 32: its DYNAMIC_QUANTIZATION_GROUP_SIZE default), so they stand against our W8A16 int8
# and our W8A8 (int8_sq) alike.
INT8_PEERS = ("llamacpp.q8_0", "ct2.int8", "openvino.int8")
PEERS_BY_PRECISION: dict[str, tuple[str, ...]] = {
    "fp32": ("hf.fp32", "llamacpp.f32", "ct2.float32", "openvino.fp32"),
    "bf16": ("llamacpp.bf16", "openvino.bf16"),
    "int8": INT8_PEERS,
    "w8a8": INT8_PEERS,
    "int4": ("llamacpp.q4_1", "openvino.int4"),
}
# each peer's batched run with 16 requests in flight (HF: a padded static batch of 16)
PEER_BATCHED = tuple(
    dict.fromkeys(f"{peer}.c16_tok_s" for peers in PEERS_BY_PRECISION.values() for peer in peers)
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


def precision_comparisons(precision: str) -> tuple[Comparison, ...]:
    """One precision of ours against the best peer at that precision (single-request decode, and 16 at
    once in-process), against its own in-process engine when served, and against the machine's memory
    bandwidth limit on single-request decode (pipeline.bench.machine)."""
    peers = PEERS_BY_PRECISION[precision]
    ours = f"llmpipe.{precision}"
    return (
        Comparison(
            f"{precision}_single_vs_best_peer",
            f"single-request decode, {precision} vs the best {precision} peer",
            (f"{ours}.single_decode_tok_s",),
            tuple(f"{peer}.single_decode_tok_s" for peer in peers),
        ),
        Comparison(
            f"{precision}_c16_vs_best_peer",
            f"16 concurrent in-process, {precision} vs the best {precision} peer with 16 in flight",
            (f"{ours}.inprocess.c16_tok_s",),
            tuple(f"{peer}.c16_tok_s" for peer in peers),
        ),
        Comparison(
            f"{precision}_served_vs_inprocess_c16",
            f"16 concurrent through Triton vs in-process ({precision})",
            (f"{ours}.triton.c16_tok_s",),
            (f"{ours}.inprocess.c16_tok_s",),
        ),
        Comparison(
            f"{precision}_single_vs_bandwidth_limit",
            f"single-request decode vs the memory bandwidth limit ({precision})",
            (f"{ours}.single_decode_tok_s",),
            (f"machine.{precision}.decode_limit_tok_s",),
        ),
    )


PEER_COMPARISONS: tuple[Comparison, ...] = (
    *(c for p in OURS for c in precision_comparisons(p)[:2]),
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
