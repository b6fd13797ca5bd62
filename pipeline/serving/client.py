"""Talk to a served llmpipe (or tensorrtllm_backend) repository: gRPC through tritonclient, or HTTP through
Triton's generate extension. Both speak the ensemble's tensors (text_input, max_tokens, ... -> text_output)
and work with the `ensemble` and `tensorrt_llm_bls` models alike.

    with GrpcClient("127.0.0.1:8001") as client:
        for chunk in client.stream("Write a haiku about GPUs", GenerationOptions(max_tokens=32, stream=True)):
            print(chunk.text, end="", flush=True)

gRPC uses the bidirectional stream API by default, which works for decoupled and non-decoupled
deployments alike; `infer()` is the unary call (non-decoupled deployments only).
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import ServingError

DEFAULT_MODEL = "ensemble"


@dataclass(frozen=True)
class GenerationOptions:
    """The ensemble's optional inputs; None leaves an input out (the server's default applies)."""

    max_tokens: int = 64
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    return_log_probs: bool | None = None
    exclude_input_in_output: bool | None = None


@dataclass
class Chunk:
    """One response: the text it adds (streaming) or the whole text."""

    text: str
    cum_log_prob: float | None = None
    log_probs: list[float] = field(default_factory=list)


@dataclass
class Completion:
    text: str
    chunks: list[str]
    cum_log_prob: float | None
    log_probs: list[float]
    time_to_first_chunk_s: float | None
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "text_output": self.text,
            "chunks": self.chunks,
            "cum_log_probs": self.cum_log_prob,
            "output_log_probs": self.log_probs,
            "time_to_first_chunk_s": self.time_to_first_chunk_s,
            "latency_s": self.latency_s,
        }


# input name -> (Triton datatype, numpy dtype)
_SCALARS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("INT32", np.int32), "stream": ("BOOL", np.bool_), "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
    "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "min_tokens": ("INT32", np.int32), "end_id": ("INT32", np.int32),
    "pad_id": ("INT32", np.int32), "return_log_probs": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
}  # fmt: skip


def request_tensors(prompt: str, options: GenerationOptions) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (Triton datatype, array with batch dimension 1) for every input to send."""
    tensors = {"text_input": ("BYTES", np.array([[prompt.encode("utf-8")]], dtype=np.object_))}
    for name, (datatype, dtype) in _SCALARS.items():
        value = getattr(options, name)
        if value is not None:
            tensors[name] = (datatype, np.array([[value]], dtype=dtype))
    for name in ("stop_words", "bad_words"):
        words = getattr(options, name)
        if words:
            tensors[name] = ("BYTES", np.array([[w.encode("utf-8") for w in words]], dtype=np.object_))
    return tensors


def request_json(prompt: str, options: GenerationOptions) -> dict[str, Any]:
    """The body of POST /v2/models/<model>/generate[_stream]."""
    body: dict[str, Any] = {"text_input": prompt}
    for name in _SCALARS:
        value = getattr(options, name)
        if value is not None:
            body[name] = value
    for name in ("stop_words", "bad_words"):
        if getattr(options, name):
            body[name] = list(getattr(options, name))
    return body


def _first(value: Any) -> Any:
    array = np.asarray(value)
    return array.reshape(-1)[0] if array.size else None


def _text(value: Any) -> str:
    item = _first(value)
    if item is None:
        return ""
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _chunk(text: Any, cum: Any, log_probs: Any) -> Chunk:
    cum_value = _first(cum) if cum is not None else None
    return Chunk(
        _text(text),
        None if cum_value is None else float(cum_value),
        [] if log_probs is None else [float(v) for v in np.asarray(log_probs).reshape(-1)],
    )


def collect(chunks: Iterator[Chunk], started: float | None = None) -> Completion:
    started = time.monotonic() if started is None else started
    texts, first, last = [], None, None
    log_probs: list[float] = []
    for chunk in chunks:
        first = first if first is not None else time.monotonic() - started
        texts.append(chunk.text)
        log_probs += chunk.log_probs
        last = chunk
    return Completion(
        "".join(texts),
        texts,
        last.cum_log_prob if last else None,
        log_probs,
        first,
        time.monotonic() - started,
    )


class GrpcClient:
    def __init__(
        self, url: str = "127.0.0.1:8001", model: str = DEFAULT_MODEL, timeout_s: float = 600.0
    ) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout_s = timeout_s
        self.url = url

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    def _inputs(self, prompt: str, options: GenerationOptions) -> list[Any]:
        inputs = []
        for name, (datatype, array) in request_tensors(prompt, options).items():
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def stream(
        self,
        prompt: str,
        options: GenerationOptions,
        request_id: str | None = None,
        cancel_after: int | None = None,
    ) -> Iterator[Chunk]:
        """Responses as they arrive, over the gRPC stream API. `cancel_after=N` cancels the request after
        N responses (closing the stream with cancel_requests, as a client that goes away does)."""
        from tritonclient.utils import InferenceServerException

        results: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.client.start_stream(callback=lambda result=None, error=None: results.put((result, error)))
        received, finished = 0, False
        try:
            try:
                self.client.async_stream_infer(
                    self.model,
                    self._inputs(prompt, options),
                    request_id=request_id or uuid.uuid4().hex,
                    enable_empty_final_response=True,
                )
            except InferenceServerException as err:
                # A broken stream reports its cause through the callback: prefer that message.
                with contextlib.suppress(queue.Empty):
                    err = results.get(timeout=1.0)[1] or err
                raise self._error(err) from None
            while True:
                try:
                    result, error = results.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise ServingError(
                        f"no response from {self.model} within {self.timeout_s:.0f}s"
                    ) from None
                if error is not None:
                    raise self._error(error)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                if response.outputs:
                    received += 1
                    yield _chunk(
                        result.as_numpy("text_output"),
                        result.as_numpy("cum_log_probs"),
                        result.as_numpy("output_log_probs"),
                    )
                if final is None or final.bool_param:
                    finished = True
                    return
                if cancel_after is not None and received >= cancel_after:
                    return
        finally:
            # NOTE: cancel only a request that is still running: cancelling one whose final response already
            # arrived makes Triton 2.51 leak the ensemble, which then never unloads (exit timeout at stop).
            self.client.stop_stream(cancel_requests=not finished)

    def _error(self, err: Any) -> ServingError:
        message = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
        if "UNAVAILABLE" in str(err) and "connect" in str(err).lower():
            return ServingError(
                f"cannot reach {self.url}: {message}",
                hint="Is the server running? Start it with `llmpipe serve`.",
            )
        return ServingError(f"{self.model}: {message}")

    def generate(self, prompt: str, options: GenerationOptions, request_id: str | None = None) -> Completion:
        started = time.monotonic()
        return collect(self.stream(prompt, options, request_id), started)

    def infer(self, prompt: str, options: GenerationOptions) -> Completion:
        """One unary ModelInfer call (non-decoupled deployments; decoupled ones answer UNIMPLEMENTED)."""
        from tritonclient.utils import InferenceServerException

        started = time.monotonic()
        try:
            result = self.client.infer(
                self.model, self._inputs(prompt, options), client_timeout=self.timeout_s
            )
        except InferenceServerException as err:
            raise self._error(err) from None
        chunk = _chunk(
            result.as_numpy("text_output"),
            result.as_numpy("cum_log_probs"),
            result.as_numpy("output_log_probs"),
        )
        return collect(iter([chunk]), started)


class HttpClient:
    """Triton's generate extension: POST /v2/models/<model>/generate and /generate_stream (SSE)."""

    def __init__(
        self, url: str = "127.0.0.1:8000", model: str = DEFAULT_MODEL, timeout_s: float = 600.0
    ) -> None:
        self.base = url if url.startswith("http") else f"http://{url}"
        self.model = model
        self.timeout_s = timeout_s

    def _post(self, endpoint: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.base}/v2/models/{self.model}/{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")
            with contextlib.suppress(json.JSONDecodeError):
                detail = json.loads(detail).get("error", detail)
            raise ServingError(f"{self.model}: HTTP {err.code}: {detail}") from None
        except urllib.error.URLError as err:
            raise ServingError(
                f"cannot reach {self.base}: {err.reason}",
                hint="Is the server running? Start it with `llmpipe serve`.",
            ) from None

    @staticmethod
    def _from_json(data: dict[str, Any]) -> Chunk:
        if "error" in data:
            raise ServingError(str(data["error"]))
        return _chunk(data.get("text_output"), data.get("cum_log_probs"), data.get("output_log_probs"))

    def generate(self, prompt: str, options: GenerationOptions) -> Completion:
        started = time.monotonic()
        with self._post("generate", request_json(prompt, options)) as reply:
            chunk = self._from_json(json.loads(reply.read()))
        return collect(iter([chunk]), started)

    def stream(self, prompt: str, options: GenerationOptions) -> Iterator[Chunk]:
        with self._post("generate_stream", request_json(prompt, options)) as reply:
            for raw in reply:
                line = raw.decode("utf-8").strip()
                if line.startswith("data:"):
                    yield self._from_json(json.loads(line[5:]))
