"""Engine counters, latency histograms and a point-in-time snapshot with the KV and queue gauges.

Histograms have fixed buckets (Prometheus style) so that recording is O(log buckets) and a snapshot is a
few small tuples, cheap enough to take after every engine step.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.runtime.core.block_manager import BlockManager
from pipeline.runtime.core.request import Request

# Upper bounds in seconds; the implicit last bucket is +Inf.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; len(bounds) + 1 (the last is +Inf)
    count: int
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (inf when it falls in the last bucket)."""
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for bound, num in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += num
            if seen >= rank:
                return bound
        return float("inf")


@dataclass
class Histogram:
    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.count, self.sum)


@dataclass(frozen=True)
class MetricsSnapshot:
    # gauges
    num_requests_waiting: int
    num_requests_running: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int  # includes the cached-free blocks below
    num_kv_blocks_cached_free: int  # free but still holding a reusable prefix
    # counters since the engine started
    num_requests_added: int
    num_requests_finished: dict[str, int]  # by finish reason: stop | length | abort | error
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    num_batched_tokens: int  # tokens computed over all steps (prompt chunks, decodes, drafts)
    num_preemptions: int
    num_reuse_hits: int  # admissions that reused at least one cached block
    num_kv_blocks_allocated: int
    num_kv_blocks_reused: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    # latency histograms, seconds
    queue_time: HistogramSnapshot
    ttft: HistogramSnapshot
    itl: HistogramSnapshot
    e2e_latency: HistogramSnapshot

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineMetrics:
    """Counters and histograms the scheduler updates as requests move; gauges are read at snapshot time."""

    num_requests_added: int = 0
    num_requests_finished: dict[str, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    queue_time: Histogram = field(default_factory=Histogram)
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    e2e_latency: Histogram = field(default_factory=Histogram)

    def record_tokens(self, request: Request, num_new_tokens: int, now: float) -> None:
        """Stamp a request's token times; one ITL sample per step (averaged over its tokens)."""
        stats = request.stats
        if stats.first_token_time is None:
            stats.first_token_time = now
            self.ttft.observe(now - stats.arrival_time)
        elif stats.last_token_time is not None:
            self.itl.observe((now - stats.last_token_time) / num_new_tokens)
        stats.last_token_time = now
        self.num_generated_tokens += num_new_tokens

    def record_finished(self, request: Request, now: float) -> None:
        reason = request.finish_reason or "unknown"
        self.num_requests_finished[reason] = self.num_requests_finished.get(reason, 0) + 1
        self.e2e_latency.observe(now - request.stats.arrival_time)

    def snapshot(self, num_waiting: int, num_running: int, block_manager: BlockManager) -> MetricsSnapshot:
        bm = block_manager
        return MetricsSnapshot(
            num_requests_waiting=num_waiting,
            num_requests_running=num_running,
            num_kv_blocks_total=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            num_kv_blocks_cached_free=bm.num_cached_free_blocks,
            num_requests_added=self.num_requests_added,
            num_requests_finished=dict(self.num_requests_finished),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            num_batched_tokens=self.num_batched_tokens,
            num_preemptions=self.num_preemptions,
            num_reuse_hits=bm.num_reuse_hits,
            num_kv_blocks_allocated=bm.num_blocks_allocated,
            num_kv_blocks_reused=bm.num_blocks_reused,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            queue_time=self.queue_time.snapshot(),
            ttft=self.ttft.snapshot(),
            itl=self.itl.snapshot(),
            e2e_latency=self.e2e_latency.snapshot(),
        )
