"""The load generator against a fake target with known delays: concurrency, warm-up exclusion, timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pipeline.bench.load import poisson_offsets, run_closed_loop, run_open_loop, sweep_concurrency
from pipeline.bench.requests import BenchRequest

TTFT_S = 0.05
ITL_S = 0.01


class FakeTarget:
    """Sleeps TTFT_S, then streams one token every ITL_S; remembers how many requests overlapped."""

    name = "fake"

    def __init__(self, fail_index: int | None = None) -> None:
        self.fail_index = fail_index
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen: list[int] = []
        self.finished_at: list[float] = []

    def stream(self, request: BenchRequest) -> Iterator[int]:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.seen.append(request.index)
        try:
            time.sleep(TTFT_S)
            if request.index == self.fail_index:
                raise ConnectionError("server went away")
            yield 1
            for _ in range(request.output_tokens - 1):
                time.sleep(ITL_S)
                yield 1
        finally:
            with self.lock:
                self.in_flight -= 1
                self.finished_at.append(time.perf_counter())


def _requests(count: int, output_tokens: int = 4) -> list[BenchRequest]:
    return [BenchRequest(index=i, output_tokens=output_tokens, input_ids=(1, 2, 3)) for i in range(count)]


def test_closed_loop_holds_concurrency_and_measures_known_delays() -> None:
    target = FakeTarget()
    result = run_closed_loop(target, _requests(12), concurrency=4)
    assert target.max_in_flight == 4
    assert len(result.records) == 12
    m = result.metrics()
    assert m.num_completed == 12 and m.num_errors == 0 and m.total_output_tokens == 48
    # sleeps only ever overshoot; the slack absorbs a busy 2-core machine
    assert m.ttft_s is not None and TTFT_S <= m.ttft_s.p50 < TTFT_S + 0.1
    assert m.itl_s is not None and ITL_S <= m.itl_s.p50 < ITL_S + 0.04
    assert m.tpot_s is not None and ITL_S <= m.tpot_s.mean < ITL_S + 0.04
    # 12 requests of ~0.08 s over 4 workers: about 3 rounds, far from serial (12 rounds)
    assert 3 * 0.08 <= result.duration_s < 8 * 0.08


def test_concurrency_one_is_serial() -> None:
    target = FakeTarget()
    result = run_closed_loop(target, _requests(3), concurrency=1)
    assert target.max_in_flight == 1
    starts = [r.start for r in result.records]
    ends = [r.end for r in result.records]
    assert all(ends[i] <= starts[i + 1] for i in range(2))


def test_warmup_requests_run_first_and_are_not_recorded() -> None:
    target = FakeTarget()
    warmup = [BenchRequest(index=100 + i, output_tokens=2, input_ids=(9,)) for i in range(3)]
    result = run_closed_loop(target, _requests(5), concurrency=2, warmup=warmup)
    assert len(target.seen) == 8  # 3 warm-up + 5 measured
    assert sorted(target.seen[:3]) == [100, 101, 102]
    assert sorted(r.index for r in result.records) == [0, 1, 2, 3, 4]
    assert result.num_warmup == 3
    warmup_end = max(target.finished_at[:3])
    assert min(r.start for r in result.records) >= warmup_end


def test_duration_bound_stops_sending_new_requests() -> None:
    target = FakeTarget()
    result = run_closed_loop(target, _requests(100), concurrency=2, max_duration_s=0.15)
    # each request takes ~0.08 s: only the first couple of rounds start before the deadline
    assert 2 <= len(result.records) <= 8
    assert len(target.seen) == len(result.records)


def test_errors_are_recorded_not_raised() -> None:
    target = FakeTarget(fail_index=1)
    result = run_closed_loop(target, _requests(3), concurrency=3)
    failed = [r for r in result.records if not r.ok]
    assert [r.index for r in failed] == [1]
    assert failed[0].error == "ConnectionError: server went away"
    assert result.metrics().num_errors == 1


def test_sweep_runs_each_concurrency() -> None:
    target = FakeTarget()
    results = sweep_concurrency(target, _requests(4, output_tokens=2), [1, 4])
    assert [r.concurrency for r in results] == [1, 4]
    assert all(len(r.records) == 4 for r in results)
    assert results[1].duration_s < results[0].duration_s


def test_poisson_offsets_are_seeded_and_have_the_right_rate() -> None:
    offsets = poisson_offsets(4000, rate=20.0, seed=7)
    assert offsets == poisson_offsets(4000, rate=20.0, seed=7)
    assert offsets != poisson_offsets(4000, rate=20.0, seed=8)
    assert all(b > a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20.0, rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        poisson_offsets(3, rate=0, seed=0)


def test_open_loop_sends_on_schedule_without_waiting_for_responses() -> None:
    target = FakeTarget()
    requests = _requests(8, output_tokens=3)
    result = run_open_loop(target, requests, rate=100.0, seed=3)
    offsets = poisson_offsets(8, 100.0, 3)
    first = result.records[0].start - offsets[0]
    for record, offset in zip(result.records, offsets, strict=True):
        assert record.start - first == pytest.approx(offset, abs=0.05)
    # arrivals every ~10 ms against ~70 ms requests: they overlap
    assert target.max_in_flight >= 3
    assert result.mode == "open" and result.request_rate == 100.0


def test_open_loop_concurrency_cap_and_duration_bound() -> None:
    target = FakeTarget()
    result = run_open_loop(target, _requests(20, output_tokens=2), rate=200.0, seed=1, max_concurrency=2)
    assert target.max_in_flight <= 2 and len(result.records) == 20
    bounded = run_open_loop(
        FakeTarget(), _requests(50, output_tokens=2), rate=20.0, seed=1, max_duration_s=0.3
    )
    offsets = poisson_offsets(50, 20.0, 1)
    assert len(bounded.records) == sum(1 for o in offsets if o < 0.3)


def test_inprocess_target_streams_engine_thread_outputs_at_forced_length() -> None:
    from pipeline.bench.clients.inprocess import InProcessTarget
    from pipeline.runtime.engine.async_engine import EngineThread
    from tests.helpers import make_engine

    engine, _runner = make_engine(num_blocks=64, block_size=4)
    target = InProcessTarget(EngineThread(engine), end_id=0)
    try:
        requests = [
            BenchRequest(index=i, output_tokens=3 + i, input_ids=tuple(range(1, 6 + i))) for i in range(6)
        ]
        result = run_closed_loop(target, requests, concurrency=3)
    finally:
        target.close()
    m = result.metrics()
    assert m.num_errors == 0 and m.num_short_outputs == 0
    assert sorted(r.num_output_tokens for r in result.records) == [3, 4, 5, 6, 7, 8]


def test_inprocess_target_with_log_probs_counts_tokens_by_them() -> None:
    from pipeline.bench.clients.inprocess import InProcessTarget
    from pipeline.runtime.engine.async_engine import EngineThread
    from tests.helpers import make_engine

    engine, _runner = make_engine(num_blocks=64, block_size=4)
    target = InProcessTarget(EngineThread(engine), end_id=0, log_probs=True)
    try:
        requests = [
            BenchRequest(index=i, output_tokens=4 + i, input_ids=tuple(range(1, 6))) for i in range(3)
        ]
        result = run_closed_loop(target, requests, concurrency=3)
    finally:
        target.close()
    m = result.metrics()
    assert m.num_errors == 0 and m.num_short_outputs == 0
    assert sorted(r.num_output_tokens for r in result.records) == [4, 5, 6]


def test_inprocess_target_reports_engine_rejections_as_errors() -> None:
    from pipeline.bench.clients.inprocess import InProcessTarget
    from pipeline.runtime.engine.async_engine import EngineThread
    from tests.helpers import make_engine

    engine, _runner = make_engine(max_input_len=8)
    target = InProcessTarget(EngineThread(engine))
    try:
        result = run_closed_loop(
            target, [BenchRequest(index=0, output_tokens=2, input_ids=tuple(range(1, 40)))], 1
        )
    finally:
        target.close()
    assert result.records[0].error is not None and result.metrics().num_errors == 1
