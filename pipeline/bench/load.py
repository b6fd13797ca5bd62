"""Load generation: closed loop at a fixed concurrency (and sweeps of it), open loop with Poisson arrivals.

Every request runs on its own worker thread and records the arrival time of each streamed response, so
the same code measures an in-process engine, a Triton endpoint or a peer engine: anything that is a
`Target`. Warm-up requests (distinct from the measured ones, so no prefix
cache hit flatters the run) run first and are left out of the records; a run stops after its requests or,
when a duration is set, stops sending new ones once it has passed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.bench.metrics import DraftCounts, RequestRecord, RunMetrics, run_duration, summarize
from pipeline.bench.requests import BenchRequest

# Open loop without a concurrency cap still bounds its threads; far above anything a 2-core host sustains.
_MAX_OPEN_LOOP_WORKERS = 512

OnRecord = Callable[[RequestRecord], None]


class Target(Protocol):
    """Something that serves one request at a time per calling thread and streams its output."""

    name: str

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        """Send `request` and yield the number of new tokens in each response as it arrives, and, once,
        the request's draft counts when the engine speculates and reports them. Must be safe to call from
        several threads at once."""
        ...


@dataclass
class RunResult:
    """One benchmark run of one system under one load setting."""

    system: str
    mode: str  # closed | open | static-batch
    concurrency: int | None  # workers (closed), cap (open, None = none), batch size (static-batch)
    request_rate: float | None  # open loop only
    records: list[RequestRecord]
    num_warmup: int = 0
    extra: dict[str, object] = field(default_factory=dict)  # e.g. precision, notes

    @property
    def duration_s(self) -> float:
        return run_duration(self.records)

    def metrics(self) -> RunMetrics:
        return summarize(self.records, self.duration_s)


def send(target: Target, request: BenchRequest) -> RequestRecord:
    """Run one request to completion and record when each response arrived; errors become the record's error."""
    record = RequestRecord(
        index=request.index,
        num_input_tokens=request.num_input_tokens,
        start=time.perf_counter(),
        end=0.0,
        num_expected_tokens=request.output_tokens,
    )
    try:
        for num_tokens in target.stream(request):
            now = time.perf_counter()
            if isinstance(num_tokens, DraftCounts):
                record.drafts = num_tokens
            elif num_tokens > 0:
                record.response_times.append(now)
                record.response_tokens.append(num_tokens)
    except Exception as err:  # noqa: BLE001 - a failed request is a measurement, not a crash of the run
        record.error = f"{type(err).__name__}: {err}"
    record.end = time.perf_counter()
    return record


def _closed_phase(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int,
    deadline: float | None,
    on_record: OnRecord | None,
) -> list[RequestRecord]:
    lock = threading.Lock()
    next_index = 0
    records: list[RequestRecord] = []

    def worker() -> None:
        nonlocal next_index
        while True:
            with lock:
                if next_index >= len(requests) or (deadline is not None and time.perf_counter() >= deadline):
                    return
                request = requests[next_index]
                next_index += 1
            record = send(target, request)
            with lock:
                records.append(record)
            if on_record is not None:
                on_record(record)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(requests)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(records, key=lambda r: r.start)


def run_closed_loop(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int,
    *,
    warmup: Sequence[BenchRequest] = (),
    max_duration_s: float | None = None,
    on_record: OnRecord | None = None,
) -> RunResult:
    """`concurrency` users, each sending its next request as soon as the previous one finished. The
    `warmup` requests run first at the same concurrency and are not recorded."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if warmup:
        _closed_phase(target, warmup, concurrency, None, None)
    deadline = None if max_duration_s is None else time.perf_counter() + max_duration_s
    records = _closed_phase(target, requests, concurrency, deadline, on_record)
    return RunResult(target.name, "closed", concurrency, None, records, num_warmup=len(warmup))


def poisson_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) with exponential gaps of mean 1/rate: a Poisson process."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def run_open_loop(
    target: Target,
    requests: Sequence[BenchRequest],
    rate: float,
    *,
    seed: int = 0,
    warmup: Sequence[BenchRequest] = (),
    max_concurrency: int | None = None,
    max_duration_s: float | None = None,
    on_record: OnRecord | None = None,
) -> RunResult:
    """Requests arrive at `rate` per second on average, whether or not earlier ones have finished. The
    `warmup` requests run first, one at a time, and are not recorded."""
    offsets = poisson_offsets(len(requests), rate, seed)
    if warmup:
        _closed_phase(target, warmup, 1, None, None)
    workers = max_concurrency or min(max(len(requests), 1), _MAX_OPEN_LOOP_WORKERS)
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def task(request: BenchRequest) -> None:
        record = send(target, request)
        with lock:
            records.append(record)
        if on_record is not None:
            on_record(record)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for request, offset in zip(requests, offsets, strict=True):
            if max_duration_s is not None and offset >= max_duration_s:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(task, request)
    records.sort(key=lambda r: r.start)
    return RunResult(target.name, "open", max_concurrency, rate, records, num_warmup=len(warmup))


def sweep_concurrency(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrencies: Sequence[int],
    *,
    warmup: Sequence[BenchRequest] = (),
    max_duration_s: float | None = None,
    on_record_factory: Callable[[int], OnRecord | None] | None = None,
) -> list[RunResult]:
    """One closed-loop run per concurrency, each with its own warm-up."""
    results = []
    for concurrency in concurrencies:
        on_record = on_record_factory(concurrency) if on_record_factory else None
        results.append(
            run_closed_loop(
                target,
                requests,
                concurrency,
                warmup=warmup,
                max_duration_s=max_duration_s,
                on_record=on_record,
            )
        )
    return results
