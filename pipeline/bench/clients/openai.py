"""The OpenAI-compatible API (`llmpipe serve`'s /v1, or any server speaking it) as a bench target: one
streamed /v1/completions request per bench request, /v1/chat/completions for a chat-template workload.

What a chunk tells: its text, not how many tokens it holds (the API's logprobs would, but llmpipe's
front-end does not implement them). So each chunk with text counts as one token as it arrives (TTFT = the
first such chunk, ITL = the gaps between them), and the final `usage` chunk (stream_options.include_usage)
settles the request's count: tokens whose text came out empty (a character split over several tokens)
are added then, as one last response. The count is never lowered: a server that sent more text chunks than
tokens is reported as such in the record's error.

Forcing the output length: the OpenAI API has no min_tokens; llmpipe's front-end, vLLM and trtllm-serve take
it as an extension. Servers that refuse unknown fields exist, so forcing is checked once against the server
when the target is made, and a refusal is a one-line error naming --no-min-tokens-equal-max.
Greedy decoding is asked with the `top_k: 1` extension, as the Triton clients ask it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from pipeline.bench.metrics import DraftCounts
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError

API_KEY_ENV = "LLMPIPE_API_KEY"  # what `llmpipe serve --api-key` reads too


def parse_openai_url(url: str) -> str:
    """The API's base URL, http(s)://host:port/v1, from http://host:port[/v1] or a bare host:port."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path.rstrip("/")
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not parts.port
        or path not in ("", "/v1")
    ):
        raise ServingError(
            f"not an OpenAI API URL: {url!r}",
            hint="use http://host:port/v1 (e.g. http://127.0.0.1:9000/v1, `llmpipe serve`'s --openai-port)",
        )
    return f"{parts.scheme}://{parts.hostname}:{parts.port}/v1"


def request_body(request: BenchRequest, model: str, min_tokens_equal_max: bool) -> tuple[str, dict[str, Any]]:
    """(endpoint path, JSON body) for one bench request."""
    if request.prompt is None:
        raise ValueError(f"request {request.index} has no prompt text (pass a tokenizer)")
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 1,  # greedy, as every other target in the comparison
    }
    if min_tokens_equal_max:
        body["min_tokens"] = request.output_tokens
    if request.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
        return "/chat/completions", body
    body["prompt"] = request.prompt
    return "/completions", body


@dataclass
class ChunkCounter:
    """Turns a stream's decoded chunks into the load generator's per-response token counts."""

    num_counted: int = 0  # tokens yielded so far (one per chunk with text)
    completion_tokens: int | None = None  # from the usage chunk

    def feed(self, chunk: dict[str, Any]) -> Iterator[int]:
        if "error" in chunk:  # an error after the 200 comes inside the stream
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ServingError(f"the server failed the request mid-stream: {message}")
        for choice in chunk.get("choices") or ():
            text = choice.get("text")
            if text is None:  # chat: the delta's content (absent in the role and the final chunk)
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.num_counted += 1
                yield 1
        usage = chunk.get("usage")
        if usage:
            self.completion_tokens = int(usage["completion_tokens"])

    def finish(self) -> Iterator[int]:
        """The tokens the usage chunk counts beyond the text chunks, once the stream ended."""
        if self.completion_tokens is None:
            raise ServingError(
                "the stream ended without a usage chunk (stream_options.include_usage): its token count is "
                "unknown"
            )
        extra = self.completion_tokens - self.num_counted
        if extra < 0:
            raise ServingError(
                f"{self.num_counted} text chunks but usage.completion_tokens={self.completion_tokens}"
            )
        if extra:
            yield extra


def sse_chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's `data:` lines, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event/id fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_counts(lines: Iterable[str]) -> Iterator[int]:
    """Per-response token counts of one streamed completion, given its SSE lines."""
    counter = ChunkCounter()
    for chunk in sse_chunks(lines):
        yield from counter.feed(chunk)
    yield from counter.finish()


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return str(error.get("message") or error)
    except (ValueError, AttributeError):
        return response.text[:300]


class OpenAITarget:
    """One httpx.Client (one kept-alive connection) per calling thread."""

    def __init__(
        self,
        url: str,
        min_tokens_equal_max: bool = True,
        name: str | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        model: str | None = None,
    ) -> None:
        self.base_url = parse_openai_url(url)
        self.min_tokens_equal_max = min_tokens_equal_max
        self.name = name or "openai"
        self.timeout_s = timeout_s
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()
        self.model = model or self._served_model()
        if min_tokens_equal_max:
            self._check_min_tokens()

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(
                base_url=self.base_url, headers=self.headers, timeout=self.timeout_s
            )
            with self._lock:
                self._clients.append(client)
        return client

    def _served_model(self) -> str:
        try:
            response = self._client().get("/models", timeout=30.0)
        except httpx.HTTPError as err:
            raise ServingError(
                f"cannot reach the OpenAI API at {self.base_url}: {err}",
                hint="start it with `llmpipe serve CONFIG --openai-port PORT`, then pass http://HOST:PORT/v1",
            ) from None
        if response.status_code != 200:
            raise ServingError(
                f"GET {self.base_url}/models: HTTP {response.status_code}: {_error_text(response)}"
            )
        models = response.json().get("data") or []
        if not models:
            raise ServingError(f"the OpenAI API at {self.base_url} serves no model")
        return str(models[0]["id"])

    def _check_min_tokens(self) -> None:
        """Whether the server takes the min_tokens extension: one 1-token request."""
        probe = BenchRequest(index=-1, output_tokens=1, prompt="Hi")
        path, body = request_body(probe, self.model, min_tokens_equal_max=True)
        body["stream"] = False
        del body["stream_options"]
        response = self._client().post(path, json=body, timeout=60.0)
        if response.status_code == 200:
            return
        raise ServingError(
            f"the OpenAI API at {self.base_url} does not take min_tokens (HTTP {response.status_code}: "
            f"{_error_text(response)}): outputs cannot be forced to their intended length",
            hint="pass --no-min-tokens-equal-max (outputs may then end early at the end-of-sequence token)",
        )

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        path, body = request_body(request, self.model, self.min_tokens_equal_max)
        with self._client().stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise ServingError(f"HTTP {response.status_code}: {_error_text(response)}")
            yield from stream_counts(response.iter_lines())

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
