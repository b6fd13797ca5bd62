"""Triton targets: streaming requests over gRPC (default) or HTTP server-sent events.

Two models can be driven: `ensemble` (text in, text out: tokenization and detokenization included, what a
user calls) and `tensorrt_llm` (token ids in and out, like tensorrtllm_backend's benchmark_core_model.py).
Each streamed response is one engine step's delta for the request. The tensorrt_llm model's ids say how
many tokens it holds; the ensemble's text does not, so its tokens are counted from output_log_probs (one
value per token in llmpipe's responses, also with speculative decoding's several tokens per step), else
as one per response. Where the model takes `return_perf_metrics`, requests set it and the final
response's acceptance outputs become the record's draft counts.
"""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from pipeline.bench.metrics import DraftCounts
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError

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
    """Tokens in one ensemble response: its log-prob values, one per token; 1 when it carries none."""
    size = 0 if output_log_probs is None else int(np.asarray(output_log_probs).size)
    return size or 1


def _scalar_params(request: BenchRequest, inputs: ModelInputs, min_tokens_equal_max: bool) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if min_tokens_equal_max:
        if inputs.min_tokens_name is None:
            raise ServingError(
                "the served model has no min_tokens/min_length input: outputs cannot be forced "
                "to their intended length",
                hint="pass --no-min-tokens-equal-max",
            )
        params[inputs.min_tokens_name] = request.output_tokens
    if "top_k" in inputs.names:
        params["top_k"] = 1  # greedy, as every other target in the comparison
    if "runtime_top_k" in inputs.names:
        params["runtime_top_k"] = 1
    return params


class TritonGrpcTarget:
    def __init__(
        self,
        url: str,
        model: str = "ensemble",
        min_tokens_equal_max: bool = True,
        name: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        import tritonclient.grpc as grpcclient

        if model not in MODELS:
            raise ServingError(f"--model {model!r} is not one of {', '.join(MODELS)}")
        self._grpc = grpcclient
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.min_tokens_equal_max = min_tokens_equal_max
        self.name = name or f"triton-grpc-{model}"
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.inputs = self._probe()
        self._requested_outputs = self._outputs_to_request()

    def _probe(self) -> ModelInputs:
        client = self._grpc.InferenceServerClient(self.url)
        try:
            if not client.is_model_ready(self.model):
                raise ServingError(f"model {self.model!r} is not ready on {self.url}")
            config = client.get_model_config(self.model, as_json=True)["config"]
        except self._grpc.InferenceServerException as err:
            raise ServingError(
                f"cannot reach Triton at {self.url} over gRPC: {err.message()}",
                hint="start it with `llmpipe serve CONFIG`, or check the port",
            ) from None
        finally:
            client.close()
        return ModelInputs.from_config(config)

    def _session(self) -> tuple[Any, queue.SimpleQueue[tuple[Any, Any]]]:
        """This thread's client with an open stream; one request at a time flows through it."""
        session = getattr(self._local, "session", None)
        if session is None:
            client = self._grpc.InferenceServerClient(self.url)
            responses: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            with self._lock:
                self._clients.append(client)
            session = self._local.session = (client, responses)
        return session

    def _tensor(self, name: str, value: np.ndarray, datatype: str) -> Any:
        array = value[np.newaxis, ...] if self.inputs.batched else value
        tensor = self._grpc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _build(self, request: BenchRequest) -> list[Any]:
        scalars = _scalar_params(request, self.inputs, self.min_tokens_equal_max)
        if self.model == "ensemble":
            if request.prompt is None:
                raise ValueError(f"request {request.index} has no prompt text (pass a tokenizer)")
            tensors = [
                self._tensor("text_input", np.array([request.prompt.encode()], dtype=object), "BYTES"),
                self._tensor("max_tokens", np.array([request.output_tokens], dtype=np.int32), "INT32"),
                self._tensor("stream", np.array([True]), "BOOL"),
            ]
        else:
            if request.input_ids is None:
                raise ValueError(f"request {request.index} has no input_ids")
            tensors = [
                self._tensor("input_ids", np.array(request.input_ids, dtype=np.int32), "INT32"),
                self._tensor("input_lengths", np.array([len(request.input_ids)], dtype=np.int32), "INT32"),
                self._tensor(
                    "request_output_len", np.array([request.output_tokens], dtype=np.int32), "INT32"
                ),
                self._tensor("streaming", np.array([True]), "BOOL"),
            ]
        tensors += [self._tensor(k, np.array([v], dtype=np.int32), "INT32") for k, v in scalars.items()]
        if self.inputs.reports_drafts:
            tensors.append(self._tensor(PERF_METRICS_INPUT, np.array([True]), "BOOL"))
        return tensors

    def _outputs_to_request(self) -> list[Any]:
        """What a client reads: the text (or ids) and what the token count and draft counts need. The server
        then serializes, and this process parses, 2-4 tensors per response instead of every output."""
        names = ["output_ids"] if self.model == "tensorrt_llm" else ["text_output", "output_log_probs"]
        names += ["total_draft_tokens", "total_accepted_draft_tokens"]
        return [self._grpc.InferRequestedOutput(n) for n in names if n in self.inputs.outputs]

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        client, responses = self._session()
        request_id = f"bench-{next(self._ids)}"
        client.async_stream_infer(
            self.model,
            self._build(request),
            outputs=self._requested_outputs,
            request_id=request_id,
            enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise ServingError(f"no response from Triton in {self.timeout_s:.0f}s") from None
            if error is not None:
                raise ServingError(f"Triton error: {error}")
            response = result.get_response()
            if response.id != request_id:  # a late response of an earlier request that failed on this stream
                continue
            final = response.parameters.get("triton_final_response")
            if response.outputs:
                yield self._count(result)
                drafts = draft_counts(
                    result.as_numpy("total_draft_tokens"), result.as_numpy("total_accepted_draft_tokens")
                )
                if drafts is not None:
                    yield drafts
            if final is not None and final.bool_param:
                return

    def _count(self, result: Any) -> int:
        if self.model == "tensorrt_llm":
            ids = result.as_numpy("output_ids")
            return 0 if ids is None else int(ids.shape[-1])
        return ensemble_token_count(result.as_numpy("output_log_probs"))

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.stop_stream()
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
    ) -> None:
        if model != "ensemble":
            raise ServingError("the HTTP generate_stream endpoint takes text: use --model ensemble (or gRPC)")
        self.host_port, self.model, self.timeout_s = url, model, timeout_s
        self.min_tokens_equal_max = min_tokens_equal_max
        self.name = name or "triton-http-ensemble"
        self.inputs = self._probe()

    def _connection(self) -> http.client.HTTPConnection:
        host, port = self.host_port.rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)

    def _probe(self) -> ModelInputs:
        conn = self._connection()
        try:
            conn.request("GET", f"/v2/models/{self.model}/config")
            response = conn.getresponse()
            body = response.read()
        except OSError as err:
            raise ServingError(
                f"cannot reach Triton at http://{self.host_port}: {err}",
                hint="start it with `llmpipe serve CONFIG`, or check the port",
            ) from None
        finally:
            conn.close()
        if response.status != 200:
            raise ServingError(
                f"model {self.model!r} is not available on http://{self.host_port} "
                f"(HTTP {response.status}: {body[:200].decode(errors='replace')})"
            )
        config = json.loads(body)
        return ModelInputs.from_config(config)

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        if request.prompt is None:
            raise ValueError(f"request {request.index} has no prompt text (pass a tokenizer)")
        body = {
            "text_input": request.prompt,
            "max_tokens": request.output_tokens,
            "stream": True,
            **_scalar_params(request, self.inputs, self.min_tokens_equal_max),
        }
        if self.inputs.reports_drafts:
            body[PERF_METRICS_INPUT] = True
        conn = self._connection()
        try:
            conn.request(
                "POST",
                f"/v2/models/{self.model}/generate_stream",
                json.dumps(body),
                {"Content-Type": "application/json", "Accept": "text/event-stream"},
            )
            response = conn.getresponse()
            if response.status != 200:
                raise ServingError(
                    f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
                )
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServingError(f"Triton error: {event['error']}")
                if "text_output" in event:
                    yield ensemble_token_count(event.get("output_log_probs"))
                drafts = draft_counts(
                    event.get("total_draft_tokens"), event.get("total_accepted_draft_tokens")
                )
                if drafts is not None:
                    yield drafts
        finally:
            conn.close()

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def triton_target(
    url: str, model: str = "ensemble", min_tokens_equal_max: bool = True, name: str | None = None
) -> TritonGrpcTarget | TritonHttpTarget:
    protocol, host_port = parse_url(url)
    cls = TritonHttpTarget if protocol == "http" else TritonGrpcTarget
    return cls(host_port, model, min_tokens_equal_max, name)
