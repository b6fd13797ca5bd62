"""Triton targets: streaming requests over gRPC (default) or HTTP server-sent events, sent by
pipeline.serving.client.

Two models can be driven: `ensemble` (text in, text out: tokenization and detokenization included, what a
user calls) and `tensorrt_llm` (token ids in and out, like tensorrtllm_backend's benchmark_core_model.py).
Each streamed response is one engine step's delta for the request. The tensorrt_llm model's ids say how
many tokens it holds; the ensemble's text does not, so EnsembleCounting counts them. Where the model
takes `return_perf_metrics`, requests set it and the final response's acceptance outputs become the
record's draft counts.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from pipeline.bench.metrics import DraftCounts
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError
from pipeline.serving.client import (
    GenerationOptions,
    GrpcClient,
    HttpClient,
    Outputs,
    output_text,
    request_json,
)

MODELS = ("ensemble", "tensorrt_llm")
PERF_METRICS_INPUT = "return_perf_metrics"


@dataclass(frozen=True)
class ModelInputs:
    """What the served model accepts, read from its config, so requests match its shapes and names."""

    names: frozenset[str]
    batched: bool  # max_batch_size > 0: every tensor carries a leading batch dim of 1
    outputs: frozenset[str] = frozenset()  # the model's output names

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelInputs:
        """From a model config as Triton returns it in JSON."""
        return cls(
            frozenset(i["name"] for i in config.get("input", [])),
            int(config.get("max_batch_size", 0)) > 0,
            frozenset(o["name"] for o in config.get("output", [])),
        )

    @property
    def reports_drafts(self) -> bool:
        return PERF_METRICS_INPUT in self.names

    @property
    def min_tokens_name(self) -> str | None:
        # tensorrtllm_backend renamed min_length -> min_tokens; accept either
        return next((n for n in ("min_tokens", "min_length") if n in self.names), None)


def parse_url(url: str) -> tuple[str, str]:
    """(protocol, host:port) from grpc://h:p, http://h:p or a bare h:p (gRPC)."""
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme not in ("grpc", "http") or not parts.hostname or not parts.port:
        raise ServingError(
            f"not a Triton endpoint URL: {url!r}",
            hint="use host:port (gRPC, e.g. localhost:8001), grpc://host:port or http://host:port",
        )
    return parts.scheme, f"{parts.hostname}:{parts.port}"


def draft_counts(num_draft_tokens: Any, num_accepted_draft_tokens: Any) -> DraftCounts | None:
    """From TensorRT-LLM's total_draft_tokens / total_accepted_draft_tokens outputs (arrays or JSON)."""
    if num_draft_tokens is None or num_accepted_draft_tokens is None:
        return None
    return DraftCounts(
        int(np.asarray(num_draft_tokens).reshape(-1)[0]),
        int(np.asarray(num_accepted_draft_tokens).reshape(-1)[0]),
    )


def ensemble_token_count(output_log_probs: Any) -> int:
    """Tokens in one ensemble response: its log-prob values, one per token (none in a stream's closing
    response that only flushes held-back text); 1 when the deployment returns no log-probs."""
    return 1 if output_log_probs is None else int(np.asarray(output_log_probs).size)


class EnsembleCounting:
    """How many tokens each of the ensemble's streamed responses carries.

    With `log_probs`, requests ask for each token's log-prob and a response counts its values: exact, but
    the engine then computes the whole vocabulary's logits every step, which a request for text alone
    spares it. Without (the default), a response's text is tokenized on its own as it arrives, as genai-perf
    counts responses: at least one token when it has text, all of a response's steps under a stream
    interval. A response ends on a token boundary, so a word split over two responses counts as generated,
    not as the whole text would re-tokenize. Without a tokenizer, a response with text is one token.
    """

    def __init__(self, log_probs: bool = False, tokenizer: Any | None = None) -> None:
        self.log_probs, self.tokenizer = log_probs, tokenizer
        self._lock = threading.Lock()  # the threads' streams share one tokenizer

    def tokens(self, outputs: Outputs) -> int:
        """Tokens in one response (0 for one without text, such as a stream's closing response)."""
        if self.log_probs:
            return ensemble_token_count(outputs("output_log_probs"))
        piece = output_text(outputs("text_output"))
        if not piece:
            return 0
        if self.tokenizer is None:
            return 1
        with self._lock:
            return max(1, len(self.tokenizer(piece, add_special_tokens=False)["input_ids"]))


def _request_body(
    request: BenchRequest, model: str, inputs: ModelInputs, min_tokens_equal_max: bool, log_probs: bool
) -> dict[str, Any]:
    if model == "ensemble":
        if request.prompt is None:
            raise ValueError(f"request {request.index} has no prompt text (pass a tokenizer)")
        options = GenerationOptions(
            max_tokens=request.output_tokens,
            stream=True,
            return_log_probs=log_probs or None,
            apply_chat_template=True if request.chat else None,
        )
        # Only what the served ensemble declares: other deployments (other releases) lack some inputs.
        body = {k: v for k, v in request_json(request.prompt, options).items() if k in inputs.names}
    else:
        if request.input_ids is None:
            raise ValueError(f"request {request.index} has no input_ids")
        body = {
            "input_ids": list(request.input_ids),
            "input_lengths": len(request.input_ids),
            "request_output_len": request.output_tokens,
            "streaming": True,
        }
    if min_tokens_equal_max:
        if inputs.min_tokens_name is None:
            raise ServingError(
                "the served model has no min_tokens/min_length input: outputs cannot be forced "
                "to their intended length",
                hint="pass --no-min-tokens-equal-max",
            )
        body[inputs.min_tokens_name] = request.output_tokens
    if "top_k" in inputs.names:
        body["top_k"] = 1  # greedy, as every other target in the comparison
    if "runtime_top_k" in inputs.names:
        body["runtime_top_k"] = 1
    if inputs.reports_drafts:
        body[PERF_METRICS_INPUT] = True
    return body


def _counts(model: str, outputs: Outputs, ensemble: EnsembleCounting) -> Iterator[int | DraftCounts]:
    """What one response adds for the load generator: its token count, and the draft counts it carries."""
    if model == "tensorrt_llm":
        ids = outputs("output_ids")
        if ids is not None:
            yield int(np.asarray(ids).shape[-1])
    elif outputs("text_output") is not None:
        yield ensemble.tokens(outputs)
    drafts = draft_counts(outputs("total_draft_tokens"), outputs("total_accepted_draft_tokens"))
    if drafts is not None:
        yield drafts


class TritonGrpcTarget:
    """One GrpcClient per calling thread, whose kept-open stream carries that thread's requests."""

    def __init__(
        self,
        url: str,
        model: str = "ensemble",
        min_tokens_equal_max: bool = True,
        name: str | None = None,
        timeout_s: float = 600.0,
        counting: EnsembleCounting | None = None,
    ) -> None:
        if model not in MODELS:
            raise ServingError(f"--model {model!r} is not one of {', '.join(MODELS)}")
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.min_tokens_equal_max = min_tokens_equal_max
        self.counting = counting or EnsembleCounting()
        self.name = name or f"triton-grpc-{model}"
        self._local = threading.local()
        self._clients: list[GrpcClient] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        with GrpcClient(url, model, timeout_s) as probe:
            self.inputs = ModelInputs.from_config(probe.model_config())
        # What the load generator reads: the server then serializes, and this process parses, 2-4 tensors
        # per response instead of every output.
        names = ["output_ids"] if model == "tensorrt_llm" else ["text_output"]
        names += ["output_log_probs"] if model == "ensemble" and self.counting.log_probs else []
        names += ["total_draft_tokens", "total_accepted_draft_tokens"]
        self._outputs = [n for n in names if n in self.inputs.outputs]

    def _client(self) -> GrpcClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = GrpcClient(self.url, self.model, self.timeout_s, keep_stream=True)
            with self._lock:
                self._clients.append(client)
        return client

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        body = _request_body(
            request, self.model, self.inputs, self.min_tokens_equal_max, self.counting.log_probs
        )
        responses = self._client().responses(
            body, f"bench-{next(self._ids)}", self._outputs, batched=self.inputs.batched
        )
        for outputs in responses:
            yield from _counts(self.model, outputs, self.counting)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()


class TritonHttpTarget:
    """The ensemble's `generate_stream` endpoint: one JSON event per response (server-sent events)."""

    def __init__(
        self,
        url: str,
        model: str = "ensemble",
        min_tokens_equal_max: bool = True,
        name: str | None = None,
        timeout_s: float = 600.0,
        counting: EnsembleCounting | None = None,
    ) -> None:
        if model != "ensemble":
            raise ServingError("the HTTP generate_stream endpoint takes text: use --model ensemble (or gRPC)")
        self.model = model
        self.min_tokens_equal_max = min_tokens_equal_max
        self.counting = counting or EnsembleCounting()
        self.name = name or "triton-http-ensemble"
        self.client = HttpClient(url, model, timeout_s)
        self.inputs = ModelInputs.from_config(self.client.model_config())

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        body = _request_body(
            request, self.model, self.inputs, self.min_tokens_equal_max, self.counting.log_probs
        )
        for outputs in self.client.responses(body):
            yield from _counts(self.model, outputs, self.counting)

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def triton_target(
    url: str,
    model: str = "ensemble",
    min_tokens_equal_max: bool = True,
    name: str | None = None,
    counting: EnsembleCounting | None = None,
) -> TritonGrpcTarget | TritonHttpTarget:
    protocol, host_port = parse_url(url)
    cls = TritonHttpTarget if protocol == "http" else TritonGrpcTarget
    return cls(host_port, model, min_tokens_equal_max, name, counting=counting)
