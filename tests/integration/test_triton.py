"""A REAL tritonserver (Triton 2.51 from nvidia-pytriton) serving the tiny model's rendered repository: HTTP
and gRPC, streaming and unary, ensemble and BLS, all equal to the in-process engine's greedy output; 16
concurrent streams; cancellation freeing KV blocks; engine metrics on :8002; a clean shutdown.

Two servers per run: one decoupled (streaming) deployment, which sends a response every STREAM_INTERVAL
engine steps (serving.stream_interval), and one non-decoupled (unary) one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.errors import ServingError
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.client import GenerationOptions, GrpcClient, HttpClient
from pipeline.serving.server.command import ServerOptions
from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import MULTIBYTE_PROMPT, EngineStream, metric, scrape_metrics, serve_tiny

pytestmark = pytest.mark.triton
PROMPTS = ("The quick brown fox", MULTIBYTE_PROMPT)
MAX_TOKENS = 24
STREAM_INTERVAL = 3


@pytest.fixture(scope="module")
def expected(tiny_engine_dir: Path) -> dict[tuple[str, int], str]:
    """prompt, max_tokens -> the in-process engine's greedy text, tokenized the way preprocessing does."""
    encoder = PromptEncoder.from_dir(tiny_engine_dir / "tokenizer")
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    prompts = [(p, MAX_TOKENS) for p in PROMPTS] + [(f"Request {i}: " + "word " * i, 40) for i in range(16)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, end_id=encoder.end_id) for _, n in prompts]
    done = engine.generate([encoder.encode_prompt(p) for p, _ in prompts], params)
    return {
        key: encoder.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        for key, r in zip(prompts, done, strict=True)
    }


# Not the shared tiny_server: test_servers_shut_down_cleanly stops both.
def _server(hf_dir: Path, engine_dir: Path, root: Path, decoupled: bool) -> Iterator[TritonServer]:
    # The streaming deployment sends a response every STREAM_INTERVAL steps, as the shipped configs do (8).
    serving = {"stream_interval": STREAM_INTERVAL} if decoupled else {}
    with serve_tiny(hf_dir, engine_dir, root / "model_repo", decoupled=decoupled, serving=serving) as server:
        yield server


@pytest.fixture(scope="module")
def streaming(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    yield from _server(tiny_llama_dir, tiny_engine_dir, tmp_path_factory.mktemp("decoupled"), decoupled=True)


@pytest.fixture(scope="module")
def unary(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    yield from _server(tiny_llama_dir, tiny_engine_dir, tmp_path_factory.mktemp("unary"), decoupled=False)


# --- decoupled (streaming) deployment ---


def test_the_engine_reports_its_load_in_the_server_log(streaming: TritonServer) -> None:
    assert streaming.log_path is not None
    log = streaming.log_path.read_text(encoding="utf-8")
    loaded = [line for line in log.splitlines() if "model runner:" in line]
    assert loaded and "KV blocks" in loaded[0] and "timed here" in loaded[0], log[-3000:]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_http_generate_and_generate_stream_equal_the_engine(
    streaming: TritonServer, expected: dict, prompt: str
) -> None:
    http = HttpClient(streaming.http_url)
    want = expected[(prompt, MAX_TOKENS)]
    assert http.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS)).text == want
    chunks = [c.text for c in http.stream(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True))]
    assert "".join(chunks) == want and len(chunks) > 1


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_equals_whole_text_equals_engine(
    streaming: TritonServer, expected: dict, model: str, prompt: str
) -> None:
    want = expected[(prompt, MAX_TOKENS)]
    with GrpcClient(streaming.grpc_url, model) as client:
        streamed = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True))
        whole = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS))
    assert streamed.text == whole.text == want
    assert len(streamed.chunks) > 1 and len(whole.chunks) == 1


def test_a_stream_sends_the_first_token_at_once_then_every_stream_interval_steps(
    streaming: TritonServer, tiny_engine_dir: Path
) -> None:
    prompt = [1, 57, 300, 12, 999, 4]
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    want = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[
        0
    ].output_token_ids
    stream = EngineStream(streaming)
    try:
        stream.generate("interval", prompt, MAX_TOKENS)
        assert stream.finished.wait(60) and not stream.errors, stream.errors
    finally:
        stream.close()
    assert stream.tokens == want
    # 24 tokens at an interval of 3: the first alone, then 3 a response, the last 2 with the final one.
    assert stream.sizes == [1] + [STREAM_INTERVAL] * 7 + [2]


def test_16_concurrent_grpc_streams_are_all_correct(streaming: TritonServer, expected: dict) -> None:
    prompts = [(f"Request {i}: " + "word " * i, 40) for i in range(16)]

    def run(prompt: str) -> str:
        with GrpcClient(streaming.grpc_url) as client:
            return client.generate(prompt, GenerationOptions(max_tokens=40, stream=True)).text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, [p for p, _ in prompts]))
    assert texts == [expected[key] for key in prompts]


def _wait_for(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_cancelled_streams_free_their_kv_blocks(streaming: TritonServer) -> None:
    before = metric(
        scrape_metrics(streaming.metrics_url), "llmpipe_requests_finished_total", finish_reason="abort"
    )
    with GrpcClient(streaming.grpc_url, "tensorrt_llm_bls") as client:
        chunks = list(
            client.stream(
                "Tell me a long story", GenerationOptions(max_tokens=900, stream=True), cancel_after=2
            )
        )
    assert len(chunks) == 2
    # A raw tensorrt_llm stream (token ids in, token ids out) that the client abandons.
    abandoned = EngineStream(streaming)
    abandoned.generate("abandoned", [1, 57, 300], 900)
    assert _wait_for(lambda: len(abandoned.sizes) >= 2)
    abandoned.close()

    def settled() -> bool:
        values = scrape_metrics(streaming.metrics_url)
        return (
            metric(values, "llmpipe_requests_finished_total", finish_reason="abort") >= before + 2
            and metric(values, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 0
        )

    assert _wait_for(settled), scrape_metrics(streaming.metrics_url)


def test_metrics_endpoint_shows_engine_gauges_and_latencies(streaming: TritonServer) -> None:
    with GrpcClient(streaming.grpc_url) as client:
        client.generate("metrics", GenerationOptions(max_tokens=4))
    values = scrape_metrics(streaming.metrics_url)
    total = metric(values, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")
    assert total == 16384 // 16
    assert metric(values, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == 16
    assert metric(values, "nv_trt_llm_request_metrics", request_type="max") == 16
    for state in ("waiting", "scheduled", "active"):
        assert metric(values, "nv_trt_llm_request_metrics", request_type=state) >= 0
    assert metric(values, "nv_inference_request_success", model="ensemble") >= 1

    def latencies_counted() -> bool:  # the latency histograms reach Triton at the next stats period
        values = scrape_metrics(streaming.metrics_url)
        return (
            metric(values, "llmpipe_time_to_first_token_seconds_count") >= 1
            and metric(values, "llmpipe_inter_token_latency_seconds_bucket", le="+Inf") >= 1
        )

    assert _wait_for(latencies_counted), scrape_metrics(streaming.metrics_url)


def test_bad_requests_are_client_errors_naming_the_input(streaming: TritonServer) -> None:
    http = HttpClient(streaming.http_url)
    with pytest.raises(ServingError, match=r"HTTP 400.*input 'max_tokens'=0: must be >= 1"):
        http.generate("hello", GenerationOptions(max_tokens=0))
    with (
        GrpcClient(streaming.grpc_url, "tensorrt_llm_bls") as client,
        pytest.raises(
            ServingError, match=r"input 'max_tokens'=5000: prompt \(\d+ tokens\) \+ max_tokens exceeds"
        ),
    ):
        client.generate("hello", GenerationOptions(max_tokens=5000))
    assert http.generate("still healthy", GenerationOptions(max_tokens=2)).text is not None


# --- non-decoupled (unary) deployment ---


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_unary_equals_the_engine(unary: TritonServer, expected: dict, model: str) -> None:
    with GrpcClient(unary.grpc_url, model) as client:
        for prompt in PROMPTS:
            assert (
                client.infer(prompt, GenerationOptions(max_tokens=MAX_TOKENS)).text
                == expected[(prompt, MAX_TOKENS)]
            )
        with pytest.raises(ServingError, match="not decoupled"):
            client.infer(PROMPTS[0], GenerationOptions(max_tokens=4, stream=True))
    http = HttpClient(unary.http_url, model)
    assert (
        http.generate(PROMPTS[1], GenerationOptions(max_tokens=MAX_TOKENS)).text
        == expected[(PROMPTS[1], MAX_TOKENS)]
    )


def test_generate_command_prints_the_answer(streaming: TritonServer, expected: dict) -> None:
    from click.testing import CliRunner

    from pipeline.cli.generate import generate

    want = expected[(PROMPTS[1], MAX_TOKENS)]
    streamed = CliRunner().invoke(
        generate, [PROMPTS[1], "--url", streaming.grpc_url, "--stream", "--max-tokens", str(MAX_TOKENS)]
    )
    assert streamed.exit_code == 0, streamed.output
    assert streamed.output == want + "\n"
    as_json = CliRunner().invoke(
        generate,
        [
            PROMPTS[1],
            "--url",
            streaming.http_url,
            "--http",
            "--json",
            "--model",
            "tensorrt_llm_bls",
            "--max-tokens",
            str(MAX_TOKENS),
        ],
    )
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)["text_output"] == want


def test_a_model_that_fails_to_load_is_reported_with_its_log_lines(
    streaming: TritonServer, tmp_path: Path
) -> None:
    repo = tmp_path / "broken"
    shutil.copytree(streaming.options.model_repository / "tensorrt_llm", repo / "tensorrt_llm", symlinks=True)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace('"guaranteed_no_evict"', '"fifo"'))
    server = TritonServer(ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0), ready_timeout_s=120)
    with pytest.raises(ServingError) as err:
        server.start()
    assert "tritonserver exited" in str(err.value)
    assert "parameter batch_scheduler_policy='fifo' is invalid: choose one of guaranteed_no_evict" in str(
        err.value
    )
    assert server.leftover_shm() == []


def test_servers_shut_down_cleanly(streaming: TritonServer, unary: TritonServer) -> None:
    # `llmpipe serve` blocks in serve_forever(): a SIGTERM to it (here: to this process) stops the server.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert streaming.serve_forever() == 0 and streaming.stopped_on_request
    for server in (streaming, unary):
        assert server.stop() == 0, [line for line in server.log_lines() if "unload" in line][-8:]
        assert server.leftover_shm() == []
        assert not any(re.search(r"Exit timeout expired|Non-graceful", line) for line in server.log_lines())
