"""Peer engines measured beside llmpipe on the same prompts and output lengths, in the same run.

Each peer has `run(requests, batch_size) -> RunResult`: batch size 1 is single-stream (one request at a
time), larger sizes use the peer's own best batched API. Records carry per-token timestamps from the
peer's streaming hook, so TTFT/ITL/TPOT mean the same as for llmpipe. Outputs are greedy and forced to
their intended length (EOS ignored), as llmpipe's are with `min_tokens = max_tokens`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.bench.requests import BenchRequest


class Peer(Protocol):
    name: str  # shown in tables, e.g. "llamacpp-q8_0"
    system: str  # measurement key prefix: hf | llamacpp | ct2
    precision: str  # measurement key part: fp32 | f32 | q8_0 | q4_1 | float32 | int8

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult: ...

    def close(self) -> None: ...


def chunks(requests: Sequence[BenchRequest], size: int) -> list[list[BenchRequest]]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


def run_static_batches(
    peer: Peer,
    generate: Callable[[list[BenchRequest]], list[RequestRecord]],
    requests: Sequence[BenchRequest],
    batch_size: int,
    on_record: OnRecord | None = None,
) -> RunResult:
    """Run `requests` as consecutive static batches of `batch_size` through `generate`."""
    records: list[RequestRecord] = []
    for batch in chunks(requests, batch_size):
        for record in generate(batch):
            records.append(record)
            if on_record is not None:
                on_record(record)
    return batch_result(peer, batch_size, records)


def records_from_steps(
    batch: Sequence[BenchRequest], start: float, step_times: Sequence[float]
) -> list[RequestRecord]:
    """Records of a static batch that produced one token per row at each of `step_times`: each request
    owns its first `output_tokens` steps (later steps are padding work it waits for no longer)."""
    records = []
    for request in batch:
        times = list(step_times[: request.output_tokens])
        records.append(
            RequestRecord(
                index=request.index,
                num_input_tokens=request.num_input_tokens,
                start=start,
                end=times[-1] if times else start,
                response_times=times,
                response_tokens=[1] * len(times),
                num_expected_tokens=request.output_tokens,
                error=None if len(times) == request.output_tokens else "peer stopped early",
            )
        )
    return records


def batch_result(
    peer: Peer, batch_size: int, records: list[RequestRecord], mode: str | None = None
) -> RunResult:
    return RunResult(
        system=peer.name,
        mode=mode or ("closed" if batch_size == 1 else "static-batch"),
        concurrency=batch_size,
        request_rate=None,
        records=records,
        extra={"precision": peer.precision, "engine": peer.system},
    )


def source_identity(*paths: Path) -> str:
    """A short key for a peer's converted model: its source files' resolved paths, sizes and modification
    times, so a rebuilt checkpoint is converted again."""
    facts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths]
    return hashlib.sha256("|".join(facts).encode()).hexdigest()[:10]
