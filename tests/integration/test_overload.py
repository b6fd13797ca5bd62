"""Overload: the queue is bounded and says so. The engine's own admission limit (EngineThread.max_pending)
in-process, then a REAL tritonserver sized for 4 requests (max_batch_size 2 + max_queue_size 2) under 10x
that concurrency over loopback: excess requests are rejected quickly with "queue is full", admitted ones
all equal the in-process engine's greedy output, KV blocks never exceed capacity and all return after."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.errors import ServingError
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.async_engine import EngineThread, QueueFullError
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.client import GenerationOptions, GrpcClient
from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import metric, scrape_metrics, serve_tiny

MAX_BATCH, MAX_QUEUE = 2, 2
CAPACITY = MAX_BATCH + MAX_QUEUE  # the engine's max_pending_requests as packaged
OVERLOAD = 10 * CAPACITY
MAX_TOKENS = 48
KV_TOKENS = 1024  # 64 blocks of 16 tokens: far fewer than the 40 requests would need together
QUEUE_FULL = r"queue is full|[Ee]xceeds maximum queue size"


def _prompts() -> list[str]:
    return [f"Overload {i}: " + "tok " * (i % 5) for i in range(OVERLOAD)]


def test_engine_thread_rejects_past_max_pending_at_once(tiny_engine_dir: Path) -> None:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    with EngineThread(engine, max_pending=3) as thread:
        streams = [thread.submit(f"r{i}", [1, 5 + i, 9], params) for i in range(3)]
        started = time.monotonic()
        for i in range(3, 30):
            with pytest.raises(
                QueueFullError, match=r"engine queue is full \(3 unfinished requests, max_pending=3\)"
            ):
                thread.submit(f"r{i}", [1, 5, 9], params)
        assert time.monotonic() - started < 1.0  # rejection never waits for the engine
        outputs = [list(s) for s in streams]
        assert all(o[-1].finish_reason == "length" for o in outputs)
        assert thread.stats().num_kv_blocks_used == 0
        # capacity is back: a new request is admitted
        assert list(thread.submit("again", [1, 2], params))[-1].finished


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    with serve_tiny(
        tiny_llama_dir,
        tiny_engine_dir,
        tmp_path_factory.mktemp("overload") / "model_repo",
        engine={"max_batch_size": MAX_BATCH},
        serving={"max_queue_size": MAX_QUEUE},
        kv_cache={"max_tokens": KV_TOKENS},
    ) as srv:
        yield srv


def _kv(server: TritonServer) -> dict[str, float]:
    values = scrape_metrics(server.metrics_url)
    return {
        kind: metric(
            values, "nv_trt_llm_kv_cache_block_metrics", model="tensorrt_llm", kv_cache_block_type=kind
        )
        for kind in ("used", "max")
    }


@pytest.mark.triton
def test_10x_overload_rejects_fast_and_serves_the_admitted_correctly(
    server: TritonServer, tiny_engine_dir: Path
) -> None:
    prompts = _prompts()
    encoder = PromptEncoder.from_dir(tiny_engine_dir / "tokenizer")
    done = LLMEngine.from_engine_dir(tiny_engine_dir).generate(
        [encoder.encode_prompt(p) for p in prompts],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, end_id=encoder.end_id) for _ in prompts],
    )
    expected = [encoder.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in done]

    peak_used, capacity, sampling = [0.0], [0.0], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            kv = _kv(server)
            peak_used[0] = max(peak_used[0], kv.get("used", 0.0))
            capacity[0] = kv.get("max", 0.0)
            time.sleep(0.05)

    barrier = threading.Barrier(OVERLOAD)

    def one(prompt: str) -> tuple[str, str, float]:
        with GrpcClient(server.grpc_url, timeout_s=120) as client:
            barrier.wait()
            started = time.monotonic()
            try:
                text = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True)).text
                return "ok", text, time.monotonic() - started
            except ServingError as err:
                return "rejected", str(err), time.monotonic() - started

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with ThreadPoolExecutor(OVERLOAD) as pool:
        results = list(pool.map(one, prompts))
    wall = time.monotonic() - started
    sampling.set()
    sampler.join()

    import re

    admitted = [(r, want) for r, want in zip(results, expected, strict=True) if r[0] == "ok"]
    rejected = [r for r in results if r[0] == "rejected"]
    assert len(admitted) + len(rejected) == OVERLOAD
    # Triton hands the first arrival to the model alone and queues the next MAX_QUEUE; on a loaded machine every
    # other client may arrive (and be turned away) before that first call returns, so 1 + MAX_QUEUE is all that
    # admission guarantees. Up to CAPACITY get in when the model takes the queued pair before the rest arrive.
    assert len(admitted) >= 1 + MAX_QUEUE and rejected, (len(admitted), len(rejected))
    wrong = [(got[1], want) for got, want in admitted if got[1] != want]
    assert wrong == []
    assert all(re.search(QUEUE_FULL, message) for _, message, _ in rejected), rejected[:3]
    # rejected at admission, not after queueing: quicker than the slowest admitted request (the bound is
    # loose because 100 clients start at once on 2 cores, and connecting alone takes seconds there)
    slowest_admitted = max(seconds for (_, _, seconds), _ in admitted)
    assert max(seconds for *_, seconds in rejected) < max(5.0, slowest_admitted), (rejected, slowest_admitted)
    assert wall < 120
    assert capacity[0] == KV_TOKENS // 16 and peak_used[0] <= capacity[0]
    deadline = time.monotonic() + 20
    while _kv(server).get("used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kv(server)["used"] == 0, "KV blocks leaked after the overload"
    print(
        f"overload: tried={OVERLOAD} admitted={len(admitted)} rejected={len(rejected)} wrong={len(wrong)} "
        f"peak_kv_used={peak_used[0]:.0f}/{capacity[0]:.0f} wall={wall:.1f}s"
    )
    with GrpcClient(server.grpc_url) as client:
        assert client.generate(prompts[0], GenerationOptions(max_tokens=MAX_TOKENS)).text == expected[0]
