"""Benchmark metrics as pure functions over per-request timestamp records.

Definitions follow the field's tools (GenAI-Perf, trtllm-bench, vLLM's benchmark_serving):
- TTFT: request sent -> first response carrying tokens (queueing, prefill and transport included);
- ITL: gap between consecutive responses divided by the tokens in the later one, one value per response
  after the first (genai-perf); all requests' values are pooled;
- TPOT: (e2e - TTFT) / (output tokens - 1) per request, i.e. decode time per token after the first
  (trtllm-bench, vLLM); requests with one output token have none;
- e2e latency: request sent -> last response;
- output tokens/s and requests/s: totals of successful requests over the run's duration;
- speculative decoding, over the successful requests whose engine reported its drafts: acceptance rate =
  accepted / draft tokens (TensorRT-LLM's acceptance_rate, pooled), accepted tokens per step = accepted
  drafts / decode steps, a request's decode steps being its output tokens after the first less its
  accepted drafts (each step adds its accepted drafts plus one token of the target's own).
Percentiles interpolate linearly between closest ranks, as numpy's default does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class DraftCounts:
    """A request's speculative-decoding totals, as the engine reports them when it finishes."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int


@dataclass
class RequestRecord:
    """What the load generator saw of one request. Times are `time.perf_counter()` seconds."""

    index: int
    num_input_tokens: int
    start: float  # request sent
    end: float  # last response received, or the error
    response_times: list[float] = field(default_factory=list)  # arrival of each response with tokens
    response_tokens: list[int] = field(default_factory=list)  # tokens in each of those responses
    num_expected_tokens: int | None = None  # what the workload asked for
    error: str | None = None
    drafts: DraftCounts | None = None  # when the engine speculated and said so

    @property
    def num_decode_steps(self) -> int:
        accepted = self.drafts.num_accepted_draft_tokens if self.drafts else 0
        return max(0, self.num_output_tokens - 1 - accepted)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.response_tokens)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    min: float
    max: float


@dataclass(frozen=True)
class RunMetrics:
    num_completed: int
    num_errors: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    output_tok_s: float
    request_s: float
    ttft_s: Distribution | None
    itl_s: Distribution | None
    tpot_s: Distribution | None
    e2e_s: Distribution | None
    num_short_outputs: int  # successful requests that returned fewer tokens than asked for
    # speculative decoding; None when no request reported drafts
    acceptance_rate: float | None = None
    accepted_tokens_per_step: float | None = None

    @property
    def decode_tok_s_per_user(self) -> float | None:
        """Per-user decode speed, 1 / mean TPOT: what "single-request decode tok/s" means at concurrency 1."""
        return None if self.tpot_s is None or self.tpot_s.mean <= 0 else 1.0 / self.tpot_s.mean

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["decode_tok_s_per_user"] = self.decode_tok_s_per_user
        return data


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    p50, p90, p95, p99 = (percentile(values, q) for q in PERCENTILES)
    return Distribution(
        count=len(values),
        mean=sum(values) / len(values),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        min=min(values),
        max=max(values),
    )


def ttft(record: RequestRecord) -> float | None:
    return record.response_times[0] - record.start if record.response_times else None


def e2e_latency(record: RequestRecord) -> float:
    return record.end - record.start


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """One value per response after the first: the gap to the previous response over its token count."""
    times, tokens = record.response_times, record.response_tokens
    return [(times[i] - times[i - 1]) / tokens[i] for i in range(1, len(times)) if tokens[i] > 0]


def time_per_output_token(record: RequestRecord) -> float | None:
    first = ttft(record)
    if first is None or record.num_output_tokens < 2:
        return None
    return (record.response_times[-1] - record.start - first) / (record.num_output_tokens - 1)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> RunMetrics:
    """Metrics of one run; failed requests count only as errors."""
    done = [r for r in records if r.ok]
    ttfts = [v for v in (ttft(r) for r in done) if v is not None]
    tpots = [v for v in (time_per_output_token(r) for r in done) if v is not None]
    itls = [v for r in done for v in inter_token_latencies(r)]
    total_out = sum(r.num_output_tokens for r in done)
    short = sum(
        1 for r in done if r.num_expected_tokens is not None and r.num_output_tokens < r.num_expected_tokens
    )
    acceptance_rate, accepted_per_step = speculation([r for r in done if r.drafts is not None])
    return RunMetrics(
        num_completed=len(done),
        num_errors=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=sum(r.num_input_tokens for r in done),
        total_output_tokens=total_out,
        output_tok_s=total_out / duration_s if duration_s > 0 else 0.0,
        request_s=len(done) / duration_s if duration_s > 0 else 0.0,
        ttft_s=distribution(ttfts),
        itl_s=distribution(itls),
        tpot_s=distribution(tpots),
        e2e_s=distribution([e2e_latency(r) for r in done]),
        num_short_outputs=short,
        acceptance_rate=acceptance_rate,
        accepted_tokens_per_step=accepted_per_step,
    )


def speculation(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """(acceptance rate, accepted tokens per decode step) pooled over records with draft counts; None
    where nothing was drafted."""
    num_drafts = sum(r.drafts.num_draft_tokens for r in records if r.drafts)
    num_accepted = sum(r.drafts.num_accepted_draft_tokens for r in records if r.drafts)
    num_steps = sum(r.num_decode_steps for r in records)
    if not num_drafts:
        return None, None
    return num_accepted / num_drafts, num_accepted / num_steps if num_steps else None


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last response: the benchmark duration throughput is divided by."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)
