"""Stress against a REAL tritonserver, with zero wrong answers, every stub the server started still alive after
each burst, and no KV block left in use:
- ten bursts of 48 gRPC ensemble streams plus 200 concurrent /generate requests alternating ensemble and
  tensorrt_llm_bls (the mix that used to make a Python stub segfault);
- ten bursts of 48 streams of 64 tokens asking for log-probs but for text_output alone (responses carrying
  outputs the request did not ask for: Triton 2.51's stub freed those without the GIL, and the first such burst
  used to crash the BLS stub and hang every stream)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.serving.server.health import HealthWatch
from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import serve_tiny, soak_script

pytestmark = [pytest.mark.triton, pytest.mark.slow]
BURSTS = 10
SUBSET_TOKENS = 64


@pytest.fixture(scope="module")
def roomy_server(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """The tiny model with a queue that admits a whole burst: every request must be answered, and right."""
    repo = tmp_path_factory.mktemp("stress") / "model_repo"
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, repo, serving={"max_queue_size": 512}) as server:
        yield server


@pytest.mark.parametrize("kind", ["burst", "subset_burst"])
def test_ten_bursts_crash_no_stub_and_answer_every_request_right(
    roomy_server: TritonServer, tiny_engine_dir: Path, kind: str
) -> None:
    tiny_server = roomy_server
    soak = soak_script()
    if kind == "burst":
        expected, run = soak.expected_texts(tiny_engine_dir), soak.burst
    else:
        expected = soak.expected_texts(tiny_engine_dir, SUBSET_TOKENS)
        run = functools.partial(soak.subset_burst, max_tokens=SUBSET_TOKENS)
    assert tiny_server.process is not None
    watch = HealthWatch(tiny_server.process.pid, tiny_server.is_ready, ready_every_s=0.0)
    assert len(watch.stubs) >= 4, watch.stubs
    for n in range(BURSTS):
        report = run(tiny_server, expected)
        print(f"burst {n + 1}: {report}")
        assert report["wrong"] == 0, report
        assert watch.check() is None and tiny_server.process.poll() is None
        settle = time.monotonic() + 20
        while soak.kv_used(tiny_server) != 0 and time.monotonic() < settle:
            time.sleep(0.1)
        assert soak.kv_used(tiny_server) == 0
