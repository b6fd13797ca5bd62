"""Each peer measured in a child process: a crash or a hang costs that peer's rows only. The fake peers
below are loaded by the real worker in a real child interpreter (`loader` names them)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

import pytest

from pipeline.bench.comparisons import measurements
from pipeline.bench.isolation import (
    Outcome,
    PeerJob,
    describe_exit,
    result_from_dict,
    result_to_dict,
    run_isolated,
    run_jobs,
)
from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import DraftCounts, RequestRecord
from pipeline.bench.peers import batch_result
from pipeline.bench.requests import BenchRequest
from pipeline.errors import MissingArtifactError

REQUESTS = tuple(BenchRequest(index=i, output_tokens=3, input_ids=(1, 2, 3 + i)) for i in range(4))
HERE = __name__


class FakePeer:
    system = "fake"

    def __init__(self, precision: str, abort_at_batch: int | None = None, hang: bool = False) -> None:
        self.name = f"fake-{precision}"
        self.precision = precision
        self.abort_at_batch = abort_at_batch
        self.hang = hang

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult:
        if batch_size == self.abort_at_batch:
            os.abort()
        if self.hang:
            time.sleep(60)
        start = time.perf_counter()
        records = [
            RequestRecord(
                index=r.index,
                num_input_tokens=r.num_input_tokens,
                start=start,
                end=start + 0.03,
                response_times=[start + 0.01, start + 0.02, start + 0.03],
                response_tokens=[1, 1, 1],
                num_expected_tokens=r.output_tokens,
            )
            for r in requests
        ]
        return batch_result(self, batch_size, records)

    def close(self) -> None:
        pass


def fine_peer(job: PeerJob) -> FakePeer:
    return FakePeer(job.precision)


def aborts_while_loading(job: PeerJob) -> FakePeer:
    os.abort()


def aborts_in_batch_16(job: PeerJob) -> FakePeer:
    return FakePeer(job.precision, abort_at_batch=16)


def not_installed(job: PeerJob) -> FakePeer:
    raise MissingArtifactError("fakepeer is not installed", hint="pip install fakepeer")


def hangs(job: PeerJob) -> FakePeer:
    return FakePeer(job.precision, hang=True)


def _job(loader: str, precision: str = "fp32") -> PeerJob:
    return PeerJob(
        family="fake",
        precision=precision,
        loader=f"{HERE}:{loader}",
        runs=((1, REQUESTS[:2]), (16, REQUESTS)),
        warmup=REQUESTS[:1],
        progress=False,
    )


def test_a_peer_that_finishes_returns_its_rows_from_the_child() -> None:
    outcome = run_isolated(_job("fine_peer"))
    assert outcome.failure is None
    assert [(r.system, r.concurrency) for r in outcome.results] == [("fake-fp32", 1), ("fake-fp32", 16)]
    assert [r.metrics().num_completed for r in outcome.results] == [2, 4]
    assert outcome.results[0].extra["engine"] == "fake"
    assert "fake.fp32.single_decode_tok_s" in measurements(outcome.results)


def test_a_peer_that_aborts_while_loading_costs_its_rows_and_says_which_signal() -> None:
    outcome = run_isolated(_job("aborts_while_loading"))
    assert outcome.results == []
    assert outcome.failure is not None
    assert outcome.failure.startswith("fake-fp32 killed by SIGABRT")


def test_a_crash_mid_run_keeps_the_runs_finished_before_it() -> None:
    outcome = run_isolated(_job("aborts_in_batch_16"))
    assert [r.concurrency for r in outcome.results] == [1]
    assert outcome.failure is not None
    assert "killed by SIGABRT" in outcome.failure
    assert "1 run(s) finished before it" in outcome.failure


def test_one_crashing_peer_does_not_cost_the_others() -> None:
    outcomes = run_jobs(
        [
            (_job("aborts_while_loading", "int8"), sys.executable),
            (_job("fine_peer", "fp32"), sys.executable),
        ]
    )
    assert [o.failure is None for o in outcomes] == [False, True]
    assert len(outcomes[1].results) == 2


def test_a_hung_peer_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    outcome = run_isolated(_job("hangs"), timeout_s=3)
    assert time.monotonic() - started < 30
    assert outcome.results == []
    assert outcome.failure is not None and "timed out after 3 s" in outcome.failure


def test_a_loader_that_raises_reports_the_error_line() -> None:
    outcome = run_isolated(_job("no_such_loader"))
    assert isinstance(outcome, Outcome)
    assert outcome.failure is not None
    assert "exited with status 1" in outcome.failure
    assert "no_such_loader" in outcome.failure


def test_a_peer_that_is_not_installed_reports_the_error_and_its_hint() -> None:
    outcome = run_isolated(_job("not_installed"))
    assert outcome.failure == (
        "fake-fp32 exited with status 1 (Error: fakepeer is not installed Hint: pip install fakepeer)"
    )


@pytest.mark.parametrize(
    ("returncode", "text"),
    [
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (-signal.SIGKILL, "killed by SIGKILL"),
        (3, "exited with status 3"),
    ],
)
def test_describe_exit(returncode: int, text: str) -> None:
    assert describe_exit(returncode) == text


def test_run_results_survive_the_json_round_trip() -> None:
    record = RequestRecord(
        index=0,
        num_input_tokens=3,
        start=1.0,
        end=2.0,
        response_times=[1.5, 2.0],
        response_tokens=[1, 2],
        num_expected_tokens=3,
        drafts=DraftCounts(4, 2),
    )
    result = RunResult("x", "closed", 1, None, [record], extra={"engine": "x", "precision": "fp32"})
    back = result_from_dict(result_to_dict(result))
    assert back == result
    assert back.metrics() == result.metrics()
