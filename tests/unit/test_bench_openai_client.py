"""The bench's OpenAI API client: streamed chunks (as llmpipe's front-end shapes them) into the load
generator's records, the request bodies, the URL forms and the min_tokens check. No server, no timing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pipeline.bench.clients import openai as client_mod
from pipeline.bench.clients.openai import (
    OpenAITarget,
    parse_openai_url,
    request_body,
    stream_counts,
)
from pipeline.bench.load import send
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError
from pipeline.serving.openai.responses import DONE, Shape, sse, usage

MODEL = "tiny"
REAL_CLIENT = httpx.Client


def _stream(chat: bool, deltas: list[str], completion_tokens: int | None) -> bytes:
    """An SSE body as routes._answer writes it."""
    shape = Shape.new(chat, MODEL)
    parts = [sse(shape.chunk("", role=True))] if chat else []
    parts += [sse(shape.chunk(d)) for d in deltas]
    parts.append(sse(shape.chunk(None if chat else "", "length")))
    if completion_tokens is not None:
        parts.append(sse(shape.usage_chunk(usage(5, completion_tokens))))
    parts.append(DONE)
    return b"".join(parts)


Handler = Callable[[httpx.Request], httpx.Response]


def _target(
    monkeypatch: pytest.MonkeyPatch, handler: Handler, min_tokens_equal_max: bool = False
) -> tuple[OpenAITarget, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        return handler(request)

    def fake_client(**kwargs: Any) -> httpx.Client:
        return REAL_CLIENT(transport=httpx.MockTransport(recording), **kwargs)

    monkeypatch.setattr(client_mod.httpx, "Client", fake_client)
    return OpenAITarget("http://127.0.0.1:9/v1", min_tokens_equal_max=min_tokens_equal_max), seen


def _sse_response(body: bytes) -> httpx.Response:
    return httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream"})


def test_completion_chunks_become_one_token_responses_and_usage_settles_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3 text chunks, but usage says 5 tokens (two came out as empty text): 1+1+1, then the 2 left.
    target, seen = _target(monkeypatch, lambda _: _sse_response(_stream(False, ["He", "llo", "!"], 5)))
    record = send(target, BenchRequest(index=0, output_tokens=5, prompt="Say hello", input_ids=(1, 2, 3)))
    target.close()
    assert record.ok, record.error
    assert record.response_tokens == [1, 1, 1, 2]
    assert record.num_output_tokens == 5
    assert len(record.response_times) == 4
    assert record.start <= record.response_times[0] <= record.end  # TTFT: the first text chunk
    assert record.num_input_tokens == 3 and record.num_expected_tokens == 5

    sent = json.loads(seen[-1].content)
    assert seen[-1].url.path == "/v1/completions"
    assert sent["prompt"] == "Say hello" and sent["model"] == MODEL
    assert sent["max_tokens"] == 5 and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["top_k"] == 1 and "min_tokens" not in sent


def test_chat_role_and_final_chunks_carry_no_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    target, seen = _target(monkeypatch, lambda _: _sse_response(_stream(True, ["a", "b", "c", "d"], 4)))
    record = send(target, BenchRequest(index=1, output_tokens=4, prompt="Hi", chat=True))
    assert record.ok, record.error
    # The role-only first chunk is not the first token: four responses, one per content delta.
    assert record.response_tokens == [1, 1, 1, 1]
    assert len(record.response_times) == 4
    sent = json.loads(seen[-1].content)
    assert seen[-1].url.path == "/v1/chat/completions"
    assert sent["messages"] == [{"role": "user", "content": "Hi"}] and "prompt" not in sent


def test_a_stream_without_usage_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = _target(monkeypatch, lambda _: _sse_response(_stream(False, ["x"], None)))
    record = send(target, BenchRequest(index=0, output_tokens=1, prompt="p"))
    assert not record.ok and "usage" in (record.error or "")


def test_errors_in_the_stream_and_http_errors_become_the_record_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape = Shape.new(False, MODEL)
    body = sse(shape.chunk("x")) + sse({"error": {"message": "the model failed: boom"}}) + DONE
    target, _ = _target(monkeypatch, lambda _: _sse_response(body))
    record = send(target, BenchRequest(index=0, output_tokens=4, prompt="p"))
    assert record.response_tokens == [1]
    assert "boom" in (record.error or "")

    refused = httpx.Response(413, json={"error": {"message": "the prompt is too long"}})
    target, _ = _target(monkeypatch, lambda _: refused)
    record = send(target, BenchRequest(index=0, output_tokens=4, prompt="p"))
    assert record.response_tokens == [] and "413" in (record.error or "")


def test_forcing_lengths_needs_a_server_that_takes_min_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    refusal = httpx.Response(400, json={"error": {"message": "min_tokens: unknown parameter"}})
    with pytest.raises(ServingError, match="min_tokens") as err:
        _target(monkeypatch, lambda _: refusal, min_tokens_equal_max=True)
    assert "--no-min-tokens-equal-max" in (err.value.hint or "")

    def accepting(request: httpx.Request) -> httpx.Response:
        if not json.loads(request.content).get("stream"):  # the probe
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        return _sse_response(_stream(False, ["a", "b"], 2))

    target, seen = _target(monkeypatch, accepting, min_tokens_equal_max=True)
    record = send(target, BenchRequest(index=0, output_tokens=2, prompt="p"))
    assert record.response_tokens == [1, 1]
    assert json.loads(seen[-1].content)["min_tokens"] == 2


def test_stream_counts_never_lowers_the_count() -> None:
    shape = Shape.new(False, MODEL)
    lines = [f"data: {json.dumps(shape.chunk(t))}" for t in ("a", "b")]
    lines += [f"data: {json.dumps(shape.usage_chunk(usage(1, 1)))}", "", "data: [DONE]"]
    counts = stream_counts(lines)
    assert [next(counts), next(counts)] == [1, 1]
    with pytest.raises(ServingError, match="completion_tokens=1"):
        next(counts)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:9000/v1", "http://127.0.0.1:9000/v1"),
        ("http://localhost:9000/v1/", "http://localhost:9000/v1"),
        ("http://localhost:9000", "http://localhost:9000/v1"),
        ("127.0.0.1:9000", "http://127.0.0.1:9000/v1"),
    ],
)
def test_url_forms(url: str, base: str) -> None:
    assert parse_openai_url(url) == base


@pytest.mark.parametrize("url", ["grpc://127.0.0.1:8001", "http://127.0.0.1/v1", "http://h:1/v2/models"])
def test_bad_urls_are_one_line_errors(url: str) -> None:
    with pytest.raises(ServingError, match="not an OpenAI API URL"):
        parse_openai_url(url)


def test_request_body_needs_prompt_text() -> None:
    with pytest.raises(ValueError, match="no prompt text"):
        request_body(BenchRequest(index=3, output_tokens=2, input_ids=(1, 2)), MODEL, False)
