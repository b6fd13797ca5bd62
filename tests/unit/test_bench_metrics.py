"""Benchmark metrics over hand-made timestamp records: the definitions of TTFT, ITL, TPOT and throughput."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench.metrics import (
    RequestRecord,
    distribution,
    e2e_latency,
    inter_token_latencies,
    percentile,
    run_duration,
    summarize,
    time_per_output_token,
    ttft,
)


def _record(
    start: float,
    times: list[float],
    tokens: list[int] | None = None,
    *,
    index: int = 0,
    end: float | None = None,
    num_expected_tokens: int | None = None,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        num_input_tokens=10,
        start=start,
        end=end if end is not None else (times[-1] if times else start),
        response_times=times,
        response_tokens=tokens if tokens is not None else [1] * len(times),
        num_expected_tokens=num_expected_tokens,
        error=error,
    )


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(q: float) -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 1.5]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_distribution_fields() -> None:
    dist = distribution([1.0, 2.0, 3.0, 4.0])
    assert dist is not None
    assert (dist.count, dist.mean, dist.min, dist.max, dist.p50) == (4, 2.5, 1.0, 4.0, 2.5)
    assert distribution([]) is None


def test_ttft_itl_tpot_e2e_of_one_streamed_request() -> None:
    # sent at 10.0; responses at 10.5 (1 token), 10.6 (1), 10.8 (2 tokens in one response), 10.9 (1)
    rec = _record(10.0, [10.5, 10.6, 10.8, 10.9], [1, 1, 2, 1], end=11.0)
    assert ttft(rec) == pytest.approx(0.5)
    assert e2e_latency(rec) == pytest.approx(1.0)
    # genai-perf: gap / tokens in the later response
    assert inter_token_latencies(rec) == pytest.approx([0.1, 0.1, 0.1])
    # (last response - first response) / (5 tokens - 1)
    assert time_per_output_token(rec) == pytest.approx(0.4 / 4)
    assert rec.num_output_tokens == 5


def test_single_token_output_has_no_itl_or_tpot() -> None:
    rec = _record(0.0, [0.2])
    assert inter_token_latencies(rec) == []
    assert time_per_output_token(rec) is None
    assert ttft(rec) == pytest.approx(0.2)


def test_summarize_counts_only_successful_requests_in_throughput() -> None:
    records = [
        _record(0.0, [0.1, 0.2, 0.3], index=0, num_expected_tokens=3),
        _record(0.0, [0.2, 0.4], index=1, num_expected_tokens=4),  # short: 2 of 4
        _record(0.5, [], index=2, end=0.6, error="ServingError: boom"),
        _record(1.0, [1.5, 1.6, 1.7, 1.8, 2.0], index=3, end=2.0),
    ]
    duration = run_duration(records)
    assert duration == pytest.approx(2.0)
    m = summarize(records, duration)
    assert (m.num_completed, m.num_errors, m.num_short_outputs) == (3, 1, 1)
    assert m.total_output_tokens == 10
    assert m.total_input_tokens == 30
    assert m.output_tok_s == pytest.approx(5.0)
    assert m.request_s == pytest.approx(1.5)
    assert m.ttft_s is not None and m.ttft_s.mean == pytest.approx((0.1 + 0.2 + 0.5) / 3)
    # ITLs pooled over requests: [0.1, 0.1] + [0.2] + [0.1, 0.1, 0.1, 0.2]
    assert m.itl_s is not None and m.itl_s.count == 7
    assert m.itl_s.mean == pytest.approx(0.9 / 7)
    assert m.tpot_s is not None and m.tpot_s.count == 3
    assert m.decode_tok_s_per_user == pytest.approx(1 / m.tpot_s.mean)
    assert m.e2e_s is not None and m.e2e_s.max == pytest.approx(1.0)


def test_summarize_of_all_failed_run_has_no_distributions() -> None:
    m = summarize([_record(0.0, [], end=1.0, error="x")], 1.0)
    assert m.num_errors == 1 and m.ttft_s is None and m.itl_s is None and m.output_tok_s == 0.0
    assert m.to_dict()["decode_tok_s_per_user"] is None


def test_measurement_keys_from_runs() -> None:
    from pipeline.bench.comparisons import measurements
    from pipeline.bench.load import RunResult

    def run(concurrency: int, extra: dict[str, object], gap: float) -> RunResult:
        recs = [_record(0.0, [0.1 + gap * i for i in range(5)], index=j) for j in range(concurrency)]
        return RunResult("x", "closed", concurrency, None, recs, extra=extra)

    ours_ip = {"engine": "llmpipe", "precision": "fp32", "path": "inprocess"}
    ours_tr = {"engine": "llmpipe", "precision": "fp32", "path": "triton"}
    out = measurements(
        [
            run(1, ours_tr, 0.05),
            run(1, ours_ip, 0.04),
            run(16, ours_tr, 0.1),
            run(16, {"engine": "hf", "precision": "fp32"}, 0.2),
            run(4, {}, 0.1),  # no engine: not a measurement
            run(1, {**ours_ip, "workload": "prompt256"}, 0.01),  # a side workload keeps to its own keys
        ]
    )
    assert out["llmpipe.fp32.triton.single_decode_tok_s"] == pytest.approx(20.0)
    assert out["llmpipe.fp32.single_decode_tok_s"] == pytest.approx(25.0)  # in-process wins
    assert out["llmpipe.fp32.triton.c16_tok_s"] == pytest.approx(16 * 5 / 0.5)
    assert out["hf.fp32.c16_tok_s"] == pytest.approx(16 * 5 / 0.9)
    assert out["llmpipe.fp32.triton.c16_ttft_p95_s"] == pytest.approx(0.1)
    assert out["llmpipe.fp32.inprocess.prompt256.c1_tok_s"] == pytest.approx(5 / 0.14)
    assert not any(k.startswith(".") or "c4_" in k for k in out)
