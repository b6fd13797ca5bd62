"""Cancellation against a REAL tritonserver (Triton 2.51): each way a request can end early aborts it in the
engine at once and frees its KV blocks, and the metrics endpoint proves it. The engine-side gauges
(nv_trt_llm_request_metrics{active}, nv_trt_llm_kv_cache_block_metrics{used}: read from the engine every
stats_check_period_ms=100) drop to 0 within about one stats period of the cancellation reaching the server,
while responses generated before it may still be on their way to the client; then
llmpipe_requests_finished_total{finish_reason="abort"} is up by one, and llmpipe_generated_tokens_total
shows the request stopped far short of max_tokens, every generated token having reached the client.

- `stop` input (tensorrtllm_backend's semantics): a request carrying stop=true and the request id of an
  in-flight request cancels that request and gets an empty final response; without a request id it is
  refused. The abort is queued before the acknowledgement is sent and lands before the engine's next step.
- server-side timeout (serving.request_timeout_s, the engine model's request_timeout_s parameter): checked
  before every engine step; the client gets "request timed out after ...s".
- HTTP SSE client disconnect on /v2/models/<model>/generate_stream: Triton cancels the request when the
  connection closes; the models see it through is_cancelled(), polled every cancellation_check_period_ms=50.
- gRPC stream cancel, on tensorrt_llm_bls and on the `ensemble` model served by the BLS's code
  (serving.ensemble=bls, as this module's server is), and in
  tests/integration/test_triton.py::test_cancelled_streams_free_their_kv_blocks.
The exact one-step mechanics are unit-tested on the engine thread (tests/unit/test_engine_core.py:
test_cancel_takes_effect_within_one_step, test_is_cancelled_is_polled_before_every_step).

Triton 2.51's own ensemble scheduler (serving.ensemble=triton, the default) passes no cancellation on to a
running step (it checks only before scheduling the next one, and tensorrt_llm is one long step): there a
cancelled ensemble stream runs on to max_tokens or serving.request_timeout_s.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.serving.client import GenerationOptions, GrpcClient, HttpClient
from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import MULTIBYTE_PROMPT, EngineStream, metric, scrape_metrics, serve_tiny

pytestmark = pytest.mark.triton
LONG = 1000  # max_tokens far past every cancellation below (max_seq_len is 1024)
PROMPT_IDS = [1, 57, 300]
TIMED_MODEL = "tensorrt_llm_timeout"  # a second engine model, only its request_timeout_s differs
TIMEOUT_S = 0.2  # the tiny model decodes ~2000 tokens/s on one thread: well short of LONG
# A streamed request's last tokens may end mid-character; the server holds them back for the next step (a
# UTF-8 character is at most 4 bytes, i.e. 4 byte-fallback tokens), and an error ends the stream without them.
MAX_HELD_BACK = 3
# From a cancellation reaching the server to an idle engine: one step, a 50 ms cancellation check where one
# applies, the 100 ms gauge refresh and the scrape; generous for a loaded 2-core machine.
IDLE_WITHIN_S = 1.5


def _add_timed_model(repo: Path) -> None:
    timed = repo / TIMED_MODEL
    shutil.copytree(repo / "tensorrt_llm", timed)
    config = (timed / "config.pbtxt").read_text()
    config = config.replace('name: "tensorrt_llm"', f'name: "{TIMED_MODEL}"')
    config = config.replace(
        'key: "request_timeout_s" value: { string_value: "600.0" }',
        f'key: "request_timeout_s" value: {{ string_value: "{TIMEOUT_S}" }}',
    )
    assert f'"{TIMED_MODEL}"' in config and f'"{TIMEOUT_S}"' in config
    (timed / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """Not the shared tiny_server: this one serves TIMED_MODEL too, and its gauges and counters see this
    module's requests alone."""
    repo = tmp_path_factory.mktemp("cancellation") / "model_repo"
    serving = {"ensemble": "bls"}  # the ensemble that passes cancellation on
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, repo, prepare=_add_timed_model, serving=serving) as srv:
        yield srv


def _wait_for(predicate: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _counts(server: TritonServer, model: str = "tensorrt_llm") -> tuple[float, float, float, float]:
    """(aborted requests, generated tokens, active requests, KV blocks in use) of one engine model."""
    values = scrape_metrics(server.metrics_url)
    return (
        metric(values, "llmpipe_requests_finished_total", model=model, finish_reason="abort"),
        metric(values, "llmpipe_generated_tokens_total", model=model),
        metric(values, "nv_trt_llm_request_metrics", model=model, request_type="active"),
        metric(values, "nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="used"),
    )


def _busy(server: TritonServer, model: str = "tensorrt_llm") -> bool:
    return _counts(server, model)[3] > 0


def _seconds_until_idle(server: TritonServer, model: str = "tensorrt_llm") -> float:
    """How long until the engine holds no request and no KV block (its gauges)."""
    started = time.monotonic()
    assert _wait_for(lambda: _counts(server, model)[2:] == (0, 0)), _counts(server, model)
    return time.monotonic() - started


def _aborted_and_freed(server: TritonServer, aborts_before: float, model: str = "tensorrt_llm") -> float:
    """Wait until the model counted one more abort and holds no KV block; its generated-token count."""

    def done() -> bool:
        aborts, _, _, used = _counts(server, model)
        return aborts >= aborts_before + 1 and used == 0

    assert _wait_for(done), (_counts(server, model), server.log_lines()[-15:])
    return _counts(server, model)[1]


def test_stop_input_cancels_the_in_flight_request_with_that_id(server: TritonServer) -> None:
    aborts, tokens_before, _, _ = _counts(server)
    victim, stopper = EngineStream(server), EngineStream(server)
    request_id = f"victim-{uuid.uuid4().hex[:8]}"
    try:
        victim.generate(request_id, PROMPT_IDS, LONG)
        assert _wait_for(lambda: len(victim.tokens) >= 2 and _busy(server))
        stopper.stop(request_id)
        assert stopper.finished.wait(10) and stopper.errors == []
        idle_after = _seconds_until_idle(server)
        assert victim.finished.wait(30) and victim.errors == []
    finally:
        victim.close()
        stopper.close()
    assert stopper.tokens == []  # the stop request's own answer is empty
    assert idle_after < IDLE_WITHIN_S, idle_after
    tokens_after = _aborted_and_freed(server, aborts)
    # every token the engine generated reached the client (nothing ran on unseen), far short of max_tokens
    assert tokens_after - tokens_before == len(victim.tokens) < LONG


def test_stop_without_a_request_id_is_refused_and_stops_nothing(server: TritonServer) -> None:
    stream = EngineStream(server)
    try:
        stream.stop("")
        assert stream.finished.wait(10)
    finally:
        stream.close()
    assert len(stream.errors) == 1 and "input 'stop'=True: names no request" in stream.errors[0], (
        stream.errors
    )


def test_server_side_timeout_aborts_the_request_and_says_so(server: TritonServer) -> None:
    aborts, tokens_before, _, _ = _counts(server, TIMED_MODEL)
    stream = EngineStream(server, TIMED_MODEL)
    started = time.monotonic()
    try:
        stream.generate(f"slow-{uuid.uuid4().hex[:8]}", PROMPT_IDS, LONG)
        assert _wait_for(lambda: _busy(server, TIMED_MODEL))
        busy_for = time.monotonic() - started + _seconds_until_idle(server, TIMED_MODEL)
        assert stream.finished.wait(30)
        elapsed = time.monotonic() - started
    finally:
        stream.close()
    assert len(stream.errors) == 1, stream.errors
    assert f"request timed out after {TIMEOUT_S:g}s (serving.request_timeout_s)" in stream.errors[0]
    # the deadline is checked before every step: the engine drops the request just after it
    assert TIMEOUT_S <= busy_for < TIMEOUT_S + IDLE_WITHIN_S, busy_for
    assert elapsed >= TIMEOUT_S
    tokens_after = _aborted_and_freed(server, aborts, TIMED_MODEL)
    generated = tokens_after - tokens_before
    assert generated - MAX_HELD_BACK <= len(stream.tokens) <= generated < LONG


def _sse_events_then_disconnect(server: TritonServer, model: str, body: dict[str, Any], events: int) -> int:
    """POST generate_stream over a raw socket, read `events` SSE events, wait until the engine gauges show the
    request, then drop the connection as a client that goes away does. Returns how many events arrived."""
    host, port = server.http_url.rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(
            f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        reader = sock.makefile("rb")
        status = reader.readline()
        assert b" 200 " in status, status
        seen = 0
        while seen < events:
            line = reader.readline()
            assert line, "the server closed the stream early"
            seen += line.startswith(b"data:")
        reader.close()
        assert _wait_for(lambda: _busy(server))
        return seen
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("ensemble", {"text_input": "Tell me a long story", "max_tokens": LONG, "stream": True}),
        ("tensorrt_llm_bls", {"text_input": "Tell me a long story", "max_tokens": LONG, "stream": True}),
        (
            "tensorrt_llm",
            {
                "input_ids": PROMPT_IDS,
                "input_lengths": len(PROMPT_IDS),
                "request_output_len": LONG,
                "streaming": True,
            },
        ),
    ],
)
def test_sse_client_disconnect_aborts_the_request(server: TritonServer, model: str, body: dict) -> None:
    aborts, tokens_before, _, _ = _counts(server)
    assert _sse_events_then_disconnect(server, model, body, events=2) == 2
    idle_after = _seconds_until_idle(server)
    assert idle_after < IDLE_WITHIN_S, idle_after
    tokens_after = _aborted_and_freed(server, aborts)
    assert tokens_after - tokens_before < LONG


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_stream_cancel_aborts_the_request(server: TritonServer, model: str) -> None:
    aborts, tokens_before, _, _ = _counts(server)
    with GrpcClient(server.grpc_url, model) as client:
        chunks = client.stream(
            "Tell me a long story", GenerationOptions(max_tokens=LONG, stream=True), cancel_after=2
        )
        assert len(list(chunks)) == 2
    idle_after = _seconds_until_idle(server)
    assert idle_after < IDLE_WITHIN_S, idle_after
    tokens_after = _aborted_and_freed(server, aborts)
    assert tokens_after - tokens_before < LONG


@pytest.mark.parametrize("prompt", ["The quick brown fox", MULTIBYTE_PROMPT])
def test_the_bls_ensemble_answers_as_tensorrt_llm_bls_does(server: TritonServer, prompt: str) -> None:
    """This module's `ensemble` is the BLS's code (serving.ensemble=bls), whole and streamed."""
    whole = GenerationOptions(max_tokens=16)
    texts = {
        model: HttpClient(server.http_url, model).generate(prompt, whole).text
        for model in ("ensemble", "tensorrt_llm_bls")
    }
    assert texts["ensemble"] == texts["tensorrt_llm_bls"] != ""
    with GrpcClient(server.grpc_url, "ensemble") as client:
        chunks = list(client.stream(prompt, GenerationOptions(max_tokens=16, stream=True)))
    assert "".join(chunk.text for chunk in chunks) == texts["ensemble"] and len(chunks) > 1
