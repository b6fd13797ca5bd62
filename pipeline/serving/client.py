"""Talk to a served llmpipe (or tensorrtllm_backend) repository: gRPC through tritonclient, or HTTP through
Triton's generate extension. Both speak the ensemble's tensors (text_input, max_tokens, ... -> text_output)
and work with the `ensemble` and `tensorrt_llm_bls` models alike.

    with GrpcClient("127.0.0.1:8001") as client:
        for chunk in client.stream("Write a haiku about GPUs", GenerationOptions(max_tokens=32, stream=True)):
            print(chunk.text, end="", flush=True)

gRPC uses the bidirectional stream API by default, which works for decoupled and non-decoupled
deployments alike; `infer()` is the unary call (non-decoupled deployments only). Below the text API,
`responses()` sends any model's inputs (the tensorrt_llm model's token ids too) and yields each response's
outputs as they arrive.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
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
    # This client asks for the completion alone; None leaves it to the deployment, whose default
    # (tensorrtllm_backend's) echoes the prompt before it.
    exclude_input_in_output: bool | None = True
    apply_chat_template: bool | None = None  # llmpipe's input: text_input as one user turn of the template


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


# input name -> (Triton datatype, numpy dtype): the ensemble's and BLS's inputs (GenerationOptions, and
# return_perf_metrics), min_length (older tensorrtllm_backend releases' min_tokens), and the tensorrt_llm
# model's own token-level inputs.
_DATATYPES: dict[str, tuple[str, Any]] = {
    "text_input": ("BYTES", np.object_), "stop_words": ("BYTES", np.object_), "bad_words": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32), "stream": ("BOOL", np.bool_), "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
    "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "min_tokens": ("INT32", np.int32), "end_id": ("INT32", np.int32),
    "pad_id": ("INT32", np.int32), "return_log_probs": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_), "return_perf_metrics": ("BOOL", np.bool_),
    "apply_chat_template": ("BOOL", np.bool_), "return_context_logits": ("BOOL", np.bool_),
    "return_generation_logits": ("BOOL", np.bool_),
    "min_length": ("INT32", np.int32), "runtime_top_k": ("INT32", np.int32),
    "input_ids": ("INT32", np.int32), "input_lengths": ("INT32", np.int32),
    "request_output_len": ("INT32", np.int32), "streaming": ("BOOL", np.bool_),
}  # fmt: skip

# What a response holds: output name -> its value (an array over gRPC, JSON over HTTP), None when absent.
Outputs = Callable[[str], Any]


def request_json(prompt: str, options: GenerationOptions) -> dict[str, Any]:
    """input name -> value for every input to send: the body of POST /v2/models/<model>/generate[_stream],
    and what request_tensors types for gRPC."""
    body: dict[str, Any] = {"text_input": prompt}
    for option in fields(options):
        value = getattr(options, option.name)
        if isinstance(value, tuple):
            if value:
                body[option.name] = list(value)
        elif value is not None:
            body[option.name] = value
    return body


def request_tensors(body: dict[str, Any], batched: bool = True) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (Triton datatype, array) for each input in `body`: a value, or a list of them, per request,
    with the leading batch dimension of 1 that a model with max_batch_size > 0 expects."""
    tensors = {}
    for name, value in body.items():
        datatype, dtype = _DATATYPES[name]
        items = value if isinstance(value, list) else [value]
        if datatype == "BYTES":
            items = [item.encode("utf-8") for item in items]
        array = np.array(items, dtype=dtype)
        tensors[name] = (datatype, array[np.newaxis, ...] if batched else array)
    return tensors


def _first(value: Any) -> Any:
    array = np.asarray(value)
    return array.reshape(-1)[0] if array.size else None


def output_text(value: Any) -> str:
    """A text output's string (text_output: a BYTES tensor over gRPC, a JSON string over HTTP)."""
    item = _first(value)
    if item is None:
        return ""
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _chunk(outputs: Outputs) -> Chunk:
    cum = outputs("cum_log_probs")
    cum_value = _first(cum) if cum is not None else None
    log_probs = outputs("output_log_probs")
    return Chunk(
        output_text(outputs("text_output")),
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
    """One request at a time, each over a gRPC stream of its own, or, with `keep_stream`, over one stream
    kept open until close(), so a client that sends many (a benchmark worker) pays for it once."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = DEFAULT_MODEL,
        timeout_s: float = 600.0,
        keep_stream: bool = False,
    ) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout_s = timeout_s
        self.url = url
        self.keep_stream = keep_stream
        self._results: queue.SimpleQueue[tuple[Any, Any]] | None = None  # the open stream's callbacks
        self._requested_outputs: dict[tuple[str, ...], list[Any]] = {}  # built once per output list

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    def model_config(self) -> dict[str, Any]:
        """The model's config as Triton returns it in JSON."""
        from tritonclient.utils import InferenceServerException

        try:
            if not self.client.is_model_ready(self.model):
                raise ServingError(f"model {self.model!r} is not ready on {self.url}")
            return dict(self.client.get_model_config(self.model, as_json=True)["config"])
        except InferenceServerException as err:
            raise self._error(err) from None

    def _requested(self, names: tuple[str, ...]) -> list[Any]:
        if names not in self._requested_outputs:
            self._requested_outputs[names] = [self._grpc.InferRequestedOutput(n) for n in names]
        return self._requested_outputs[names]

    def _inputs(self, body: dict[str, Any], batched: bool = True) -> list[Any]:
        inputs = []
        for name, (datatype, array) in request_tensors(body, batched).items():
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def _stream(self) -> queue.SimpleQueue[tuple[Any, Any]]:
        if self._results is None:
            results: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
            self.client.start_stream(callback=lambda result=None, error=None: results.put((result, error)))
            self._results = results
        return self._results

    def _close_stream(self, cancel_requests: bool) -> None:
        self._results = None
        self.client.stop_stream(cancel_requests=cancel_requests)

    def responses(
        self,
        body: dict[str, Any],
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        batched: bool = True,
        cancel_after: int | None = None,
    ) -> Iterator[Outputs]:
        """The outputs of each response as it arrives. `body` is request_json's mapping (any model's inputs),
        `outputs` the names to have sent back (None: all), `batched` whether the model takes a batch
        dimension. `cancel_after=N` cancels the request after N responses."""
        from tritonclient.utils import InferenceServerException

        results = self._stream()
        request_id = request_id or uuid.uuid4().hex
        wanted = None if outputs is None else self._requested(tuple(outputs))
        received, finished, failed = 0, False, False
        try:
            try:
                self.client.async_stream_infer(
                    self.model,
                    self._inputs(body, batched),
                    outputs=wanted,
                    request_id=request_id,
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
                    failed = True
                    raise self._error(error)
                response = result.get_response()
                if response.id != request_id:  # a late response of an earlier request that failed
                    continue
                final = response.parameters.get("triton_final_response")
                if response.outputs:
                    received += 1
                    yield result.as_numpy
                if final is None or final.bool_param:
                    finished = True
                    return
                if cancel_after is not None and received >= cancel_after:
                    return
        finally:
            # NOTE: cancel only a request that is still running: cancelling one whose final response already
            # arrived makes Triton 2.51 leak the ensemble, which then never unloads (exit timeout at stop).
            # A kept stream outlives a failed request: what else of it may still arrive carries its id.
            if not self.keep_stream or not (finished or failed):
                self._close_stream(cancel_requests=not finished)

    def stream(
        self,
        prompt: str,
        options: GenerationOptions,
        request_id: str | None = None,
        cancel_after: int | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Iterator[Chunk]:
        """Responses as they arrive, over the gRPC stream API. `cancel_after=N` cancels the request after
        N responses (closing the stream with cancel_requests, as a client that goes away does); `outputs`
        names the outputs to have sent back (None: all)."""
        body = request_json(prompt, options)
        for response in self.responses(body, request_id, outputs=outputs, cancel_after=cancel_after):
            yield _chunk(response)

    def _error(self, err: Any) -> ServingError:
        message = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
        if "UNAVAILABLE" in str(err) and "connect" in str(err).lower():
            return ServingError(
                f"cannot reach Triton at {self.url}: {message}",
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
                self.model, self._inputs(request_json(prompt, options)), client_timeout=self.timeout_s
            )
        except InferenceServerException as err:
            raise self._error(err) from None
        return collect(iter([_chunk(result.as_numpy)]), started)


class HttpClient:
    """Triton's generate extension: POST /v2/models/<model>/generate and /generate_stream (SSE)."""

    def __init__(
        self, url: str = "127.0.0.1:8000", model: str = DEFAULT_MODEL, timeout_s: float = 600.0
    ) -> None:
        self.base = url if url.startswith("http") else f"http://{url}"
        self.model = model
        self.timeout_s = timeout_s

    def _open(self, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        """GET the model's `endpoint`, or POST `body` to it as JSON."""
        request = urllib.request.Request(
            f"{self.base}/v2/models/{self.model}/{endpoint}",
            data=None if body is None else json.dumps(body).encode(),
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
                f"cannot reach Triton at {self.base}: {err.reason}",
                hint="Is the server running? Start it with `llmpipe serve`.",
            ) from None

    def model_config(self) -> dict[str, Any]:
        """The model's config as Triton returns it in JSON."""
        with self._open("config") as reply:
            return dict(json.loads(reply.read()))

    @staticmethod
    def _outputs(data: dict[str, Any]) -> Outputs:
        if "error" in data:
            raise ServingError(str(data["error"]))
        return data.get

    def generate(self, prompt: str, options: GenerationOptions) -> Completion:
        started = time.monotonic()
        with self._open("generate", request_json(prompt, options)) as reply:
            outputs = self._outputs(json.loads(reply.read()))
        return collect(iter([_chunk(outputs)]), started)

    def responses(self, body: dict[str, Any]) -> Iterator[Outputs]:
        """The outputs of each server-sent event of generate_stream as it arrives; `body` is request_json's."""
        with self._open("generate_stream", body) as reply:
            for raw in reply:
                line = raw.decode("utf-8").strip()
                if line.startswith("data:"):
                    yield self._outputs(json.loads(line[5:]))

    def stream(self, prompt: str, options: GenerationOptions) -> Iterator[Chunk]:
        for outputs in self.responses(request_json(prompt, options)):
            yield _chunk(outputs)
