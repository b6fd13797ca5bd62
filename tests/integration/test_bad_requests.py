"""Bad requests against a REAL tritonserver: every malformed request, over HTTP and gRPC, to the ensemble, the
BLS and the `tensorrt_llm` engine model, gets a client error whose message names the input, the value and
the limit; afterwards the server is healthy and a valid request still equals the in-process engine.

The shared decoupled server (tiny_server). Over the gRPC stream API Triton carries errors as messages
only (no status code), so there the message is what is checked; over HTTP the status must be 400."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.client import GenerationOptions, GrpcClient, HttpClient
from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import post_generate

pytestmark = pytest.mark.triton

LONG_PROMPT = "word " * 400  # > max_input_len=256 tokens
MEGA_PROMPT = "a" * (1 << 20)
VALID_PROMPT = "The quick brown fox"


def _i32(*values: int) -> np.ndarray:
    return np.array([list(values)], dtype=np.int32)


def _text(*values: bytes) -> np.ndarray:
    return np.array([list(values)], dtype=np.object_)


def _client_tensors(prompt: bytes = b"hello", **extra: np.ndarray | None) -> dict[str, np.ndarray]:
    """ensemble/BLS tensors: a valid request, with `extra` overriding (None removes an input)."""
    tensors = {"text_input": _text(prompt), "max_tokens": _i32(8)}
    tensors.update(extra)  # type: ignore[arg-type]
    return {k: v for k, v in tensors.items() if v is not None}


def _engine_tensors(**extra: np.ndarray | None) -> dict[str, np.ndarray]:
    tensors = {"input_ids": _i32(1, 57, 300), "input_lengths": _i32(3), "request_output_len": _i32(8)}
    tensors.update(extra)  # type: ignore[arg-type]
    return {k: v for k, v in tensors.items() if v is not None}


_TRITON_TYPES = {"O": "BYTES", "i": "INT32", "f": "FP32", "b": "BOOL", "u": "UINT64"}


def _grpc_error(server: TritonServer, model: str, tensors: dict[str, np.ndarray]) -> str:
    """Send one request on a gRPC stream; the error message it got (fails if it succeeded)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    client.start_stream(callback=lambda result=None, error=None: results.put((result, error)))
    try:
        inputs = []
        for name, array in tensors.items():
            datatype = "INT64" if array.dtype == np.int64 else _TRITON_TYPES[array.dtype.kind]
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            client.async_stream_infer(model, inputs, request_id="bad", enable_empty_final_response=True)
        except InferenceServerException as err:
            return str(err)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                return str(error)
            final = result.get_response().parameters.get("triton_final_response")
            if final is None or final.bool_param:
                raise AssertionError(f"{model} accepted {sorted(tensors)}")
    finally:
        client.stop_stream(cancel_requests=False)
        client.close()


def _http_error(server: TritonServer, model: str, body: dict[str, Any]) -> str:
    """POST /generate; the 'HTTP <code>: <error>' it answered (fails on success)."""
    status, detail = post_generate(server.http_url, model, body)
    if status == 200:
        raise AssertionError(f"{model} accepted {body}: {detail[:200]!r}")
    return f"HTTP {status}: {json.loads(detail).get('error', detail)}"


E, B, T = "ensemble", "tensorrt_llm_bls", "tensorrt_llm"
# (case id, model, gRPC tensors, expected message regex): the regex names the input, the value and the limit.
GRPC_CASES: list[tuple[str, str, dict[str, np.ndarray], str]] = [
    ("empty-prompt", E, _client_tensors(b""), r"input 'text_input'='': the prompt is empty"),
    ("empty-prompt-bls", B, _client_tensors(b""), r"input 'text_input'='': the prompt is empty"),
    (
        "prompt-over-max-input-len",
        E,
        _client_tensors(LONG_PROMPT.encode()),
        r"input 'text_input'=2000 characters: the prompt is \d+ tokens, more than the engine's max_input_len=256",
    ),
    (
        "1MB-prompt",
        B,
        _client_tensors(MEGA_PROMPT.encode()),
        r"input 'text_input'=1048576 characters: .*max_input_len=256",
    ),
    ("max-tokens-0", E, _client_tensors(max_tokens=_i32(0)), r"input 'max_tokens'=0: must be >= 1"),
    ("max-tokens-negative", B, _client_tensors(max_tokens=_i32(-5)), r"input 'max_tokens'=-5: must be >= 1"),
    (
        "max-tokens-over-max-seq-len",
        E,
        _client_tensors(max_tokens=_i32(5000)),
        r"input 'max_tokens'=5000: prompt \(\d+ tokens\) \+ max_tokens exceeds the engine's max_seq_len=1024",
    ),
    (
        "max-tokens-wrong-dtype",
        E,
        _client_tensors(max_tokens=np.array([[8.0]], np.float32)),
        r"max_tokens.*(FP32|TYPE_FP32).*(INT32|TYPE_INT32)",
    ),
    (
        "text-input-wrong-shape",
        E,
        _client_tensors(text_input=np.array([[b"a", b"b"]], dtype=np.object_)),
        r"unexpected shape for input 'text_input' for model 'ensemble'. Expected \[-1,1\], got \[1,2\]",
    ),
    (
        "text-input-batch-of-2-bls",
        B,
        _client_tensors(text_input=np.array([[b"a"], [b"b"]], dtype=np.object_), max_tokens=_i32(8, 8).T),
        r"input 'text_input'=batch of 2: one prompt per request",
    ),
    (
        "temperature-nan",
        E,
        _client_tensors(temperature=np.array([[np.nan]], np.float32)),
        r"input 'temperature'=nan: must be a finite number",
    ),
    (
        "temperature-negative-bls",
        B,
        _client_tensors(temperature=np.array([[-1.0]], np.float32), top_k=_i32(5)),
        r"input 'temperature'=-1.0: must be >= 0",
    ),
    (
        "top-p-over-1",
        E,
        _client_tensors(top_p=np.array([[1.5]], np.float32)),
        r"input 'runtime_top_p'=1.5: must be in \[0, 1\]",
    ),
    (
        "top-p-negative-bls",
        B,
        _client_tensors(top_p=np.array([[-0.25]], np.float32)),
        r"input 'runtime_top_p'=-0.25: must be in \[0, 1\]",
    ),
    ("top-k-negative", E, _client_tensors(top_k=_i32(-3)), r"input 'runtime_top_k'=-3: must be >= 0"),
    (
        "invalid-utf8-prompt",
        E,
        _client_tensors(b"ok \xff\xfe bytes"),
        r"input 'text_input'=b'ok \\xff\\xfe bytes': not valid UTF-8 \(bad byte at offset 3\)",
    ),
    (
        "invalid-utf8-prompt-bls",
        B,
        _client_tensors(b"\xc3\x28"),
        r"input 'text_input'=.*not valid UTF-8 \(bad byte at offset 0\)",
    ),
    (
        "invalid-utf8-stop-word",
        B,
        _client_tensors(stop_words=_text(b"fine", b"\xff")),
        r"input 'stop_words'=b'\\xff': not valid UTF-8",
    ),
    (
        "stop-words-wrong-dtype",
        E,
        _client_tensors(stop_words=_i32(1, 2)),
        r"stop_words.*INT32.*(BYTES|STRING)",
    ),
    ("missing-max-tokens", E, _client_tensors(max_tokens=None), r"max_tokens"),
    ("missing-text-input-bls", B, _client_tensors(text_input=None), r"text_input"),
    (
        "repetition-penalty-0",
        E,
        _client_tensors(repetition_penalty=np.array([[0.0]], np.float32)),
        r"input 'repetition_penalty'=0.0: must be > 0",
    ),
    (
        "min-tokens-over-max-tokens",
        B,
        _client_tensors(min_tokens=_i32(20)),
        r"input 'min_tokens'=20: must be in \[0, 8\]",
    ),
    # the engine model directly (token ids in)
    (
        "engine-ids-out-of-vocab",
        T,
        _engine_tensors(input_ids=_i32(1, 10**6, 3)),
        r"input 'input_ids'=\[1000000\]: token ids must be in \[0, \d+\)",
    ),
    (
        "engine-input-lengths-over-ids",
        T,
        _engine_tensors(input_lengths=_i32(7)),
        r"input 'input_lengths'=7: must be between 1 and the 3 ids sent in input_ids",
    ),
    (
        "engine-prompt-over-max-input-len",
        T,
        _engine_tensors(input_ids=_i32(*([5] * 300)), input_lengths=_i32(300)),
        r"input 'input_lengths'=300: prompt is longer than the engine's max_input_len=256",
    ),
    (
        "engine-output-len-0",
        T,
        _engine_tensors(request_output_len=_i32(0)),
        r"input 'request_output_len'=0: must be >= 1",
    ),
    (
        "engine-output-len-over-max-seq-len",
        T,
        _engine_tensors(request_output_len=_i32(2000)),
        r"input 'request_output_len'=2000: prompt \(3 tokens\) \+ request_output_len exceeds the engine's "
        r"max_seq_len=1024; ask for at most 1021",
    ),
    ("engine-missing-output-len", T, _engine_tensors(request_output_len=None), r"request_output_len"),
    (
        "engine-ids-wrong-dtype",
        T,
        _engine_tensors(input_ids=np.array([[1.0, 2.0]], np.float32)),
        r"input_ids.*FP32.*INT32",
    ),
    (
        "engine-stop-words-bad-offsets",
        T,
        _engine_tensors(stop_words_list=np.array([[[5, 6, 7], [3, 1, -1]]], np.int32)),
        r"input 'stop_words_list'=\[3, 1, -1\]: end offsets must increase and stay within the ids row",
    ),
    (
        "engine-stop-words-wrong-shape",
        T,
        _engine_tensors(stop_words_list=np.array([[[5], [1], [-1]]], np.int32)),
        r"stop_words_list.*shape",
    ),
    (
        "engine-top-p-nan",
        T,
        _engine_tensors(runtime_top_p=np.array([[np.nan]], np.float32)),
        r"input 'runtime_top_p'=nan: must be a finite number",
    ),
]

HTTP_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "http-empty-prompt",
        E,
        {"text_input": "", "max_tokens": 8},
        r"input 'text_input'='': the prompt is empty",
    ),
    (
        "http-prompt-over-max-input-len",
        B,
        {"text_input": LONG_PROMPT, "max_tokens": 8},
        r"input 'text_input'=2000 characters: .*max_input_len=256",
    ),
    (
        "http-max-tokens-negative",
        E,
        {"text_input": "hi", "max_tokens": -1},
        r"input 'max_tokens'=-1: must be >= 1",
    ),
    (
        "http-max-tokens-over-max-seq-len",
        B,
        {"text_input": "hi", "max_tokens": 4096},
        r"input 'max_tokens'=4096: .*max_seq_len=1024",
    ),
    (
        "http-temperature-negative",
        E,
        {"text_input": "hi", "max_tokens": 8, "temperature": -0.5, "top_k": 4},
        r"input 'temperature'=-0.5: must be >= 0",
    ),
    (
        "http-top-p-over-1-bls",
        B,
        {"text_input": "hi", "max_tokens": 8, "top_p": 2.0},
        r"input 'runtime_top_p'=2.0: must be in \[0, 1\]",
    ),
    (
        "http-top-k-negative",
        E,
        {"text_input": "hi", "max_tokens": 8, "top_k": -1},
        r"runtime_top_k'=-1: must be >= 0",
    ),
    ("http-missing-max-tokens", B, {"text_input": "hi"}, r"max_tokens"),
    (
        "http-engine-missing-input-lengths",
        T,
        {"input_ids": [1, 57, 300], "request_output_len": [4]},
        r"missing required input\(s\) \['input_lengths'\]",
    ),
    (
        "http-engine-output-len-negative",
        T,
        {"input_ids": [1, 57, 300], "input_lengths": [3], "request_output_len": [-4]},
        r"input 'request_output_len'=-4: must be >= 1",
    ),
]


@pytest.mark.parametrize(
    ("model", "tensors", "pattern"), [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES]
)
def test_grpc_bad_request_is_rejected_naming_input_value_and_limit(
    tiny_server: TritonServer, model: str, tensors: dict[str, np.ndarray], pattern: str
) -> None:
    message = _grpc_error(tiny_server, model, tensors)
    assert re_search(pattern, message), message
    assert "Stub process" not in message and "not healthy" not in message


@pytest.mark.parametrize(
    ("model", "body", "pattern"), [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES]
)
def test_http_bad_request_is_400_naming_input_value_and_limit(
    tiny_server: TritonServer, model: str, body: dict[str, Any], pattern: str
) -> None:
    message = _http_error(tiny_server, model, body)
    assert message.startswith("HTTP 400: "), message
    assert re_search(pattern, message), message


def test_http_json_of_the_wrong_type_is_refused_by_triton_before_any_model(tiny_server: TritonServer) -> None:
    # Triton 2.51's generate endpoint answers a JSON type mismatch with 500 and without the input's name:
    # its own parser, not ours, so only the message can be checked; nothing reaches the model.
    message = _http_error(tiny_server, E, {"text_input": "hi", "max_tokens": "many"})
    assert re_search(r"HTTP [45]\d\d: Unable to parse 'data'", message), message


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text, re.DOTALL) is not None


def test_server_is_healthy_and_correct_after_the_bad_requests(
    tiny_server: TritonServer, tiny_engine_dir: Path
) -> None:
    # Runs last in this module (definition order): every bad request above went to this server first.
    assert tiny_server.is_ready() and tiny_server.process is not None and tiny_server.process.poll() is None
    encoder = PromptEncoder.from_dir(tiny_engine_dir / "tokenizer")
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    [done] = engine.generate(
        [encoder.encode_prompt(VALID_PROMPT)],
        [SamplingParams(max_tokens=16, temperature=0.0, end_id=encoder.end_id)],
    )
    want = encoder.tokenizer.decode(done.output_token_ids, skip_special_tokens=True)
    options = GenerationOptions(max_tokens=16)
    assert HttpClient(tiny_server.http_url).generate(VALID_PROMPT, options).text == want
    for model in (E, B):
        with GrpcClient(tiny_server.grpc_url, model) as client:
            assert client.generate(VALID_PROMPT, GenerationOptions(max_tokens=16, stream=True)).text == want
    errors = [line for line in tiny_server.log_lines() if "Stub process" in line or "Segmentation" in line]
    assert errors == []
