"""The llmapi model (serving.interface=llmapi) in a REAL tritonserver (Triton 2.51), tiny random Llama: HTTP
/generate and gRPC streaming with `sampling_param_*` equal Hugging Face's greedy output, `sampling_param_stop`
ends the text at the stop string, a cancelled gRPC stream frees its KV blocks, `stop` cancels by request id,
and inputs the torch engine cannot honour are refused by name. One decoupled server for the module."""

from __future__ import annotations

import json
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import MULTIBYTE_PROMPT, metric, post_generate, scrape_metrics, serve_tiny

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_torch_thread")]
PROMPTS = ("The quick brown fox", MULTIBYTE_PROMPT)
MAX_TOKENS = 24
LONG = 900  # far past every cancellation below (max_seq_len is 1024)


@pytest.fixture(scope="module")
def encoder(tiny_engine_dir: Path) -> PromptEncoder:
    """The server's tokenization (the engine's tokenizer, special tokens added)."""
    return PromptEncoder.from_dir(tiny_engine_dir / "tokenizer")


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir: Path, encoder: PromptEncoder) -> dict[str, list[int]]:
    """prompt -> Hugging Face's greedy output ids (MAX_TOKENS at most) for the server's prompt ids."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    found = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = encoder.encode_prompt(prompt)
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            found[prompt] = out[0, len(ids) :].tolist()
    return found


def _text(encoder: PromptEncoder, ids: list[int]) -> str:
    return str(encoder.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """Not the shared tiny_server: another interface, and its counters see this module's requests alone."""
    repo = tmp_path_factory.mktemp("llmapi-served") / "model_repo"
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, repo, serving={"interface": "llmapi"}) as srv:
        yield srv


def _generate(server: TritonServer, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v2/models/tensorrt_llm/generate; the response JSON, or {"error": ..., "status": ...}."""
    status, text = post_generate(server.http_url, "tensorrt_llm", body)
    reply = dict(json.loads(text))
    return reply if status == 200 else {**reply, "status": status}


class Stream:
    """One gRPC stream to the llmapi model; every response's outputs collected as numpy dicts."""

    def __init__(self, server: TritonServer) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        config = self.client.get_model_config("tensorrt_llm", as_json=True)["config"]
        self.datatypes = {i["name"]: i["data_type"].removeprefix("TYPE_") for i in config["input"]}
        self.results: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.client.start_stream(callback=lambda result=None, error=None: self.results.put((result, error)))

    def send(self, request_id: str = "", **inputs: Any) -> None:
        """`inputs`: name -> value (or list of values), typed as the served model declares them."""
        from tritonclient.utils import triton_to_np_dtype

        tensors = []
        for name, value in inputs.items():
            datatype = "BYTES" if self.datatypes[name] == "STRING" else self.datatypes[name]
            items = value if isinstance(value, list) else [value]
            if datatype == "BYTES":
                items = [item.encode() for item in items]
            array = np.array(items, dtype=triton_to_np_dtype(datatype))
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        self.client.async_stream_infer(
            "tensorrt_llm", tensors, request_id=request_id, enable_empty_final_response=True
        )

    def responses(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Responses until the final one (or `limit` of them); an error becomes {"error": message}."""
        found: list[dict[str, Any]] = []
        while limit is None or len(found) < limit:
            result, error = self.results.get(timeout=60)
            if error is not None:
                return [*found, {"error": error.message()}]
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                found.append(outputs)
            final = response.parameters.get("triton_final_response")
            if final is None or final.bool_param:
                break
        return found

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _stream(server: TritonServer, **inputs: Any) -> list[dict[str, Any]]:
    stream = Stream(server)
    try:
        stream.send(**inputs)
        return stream.responses()
    finally:
        stream.close()


def _string(outputs: dict[str, Any], name: str) -> str:
    return bytes(outputs[name].reshape(-1)[0]).decode()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_http_generate_equals_hf_greedy(
    server: TritonServer, encoder: PromptEncoder, hf_greedy: dict, prompt: str
) -> None:
    completion = _text(encoder, hf_greedy[prompt])
    body = {"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS}
    alone = {**body, "sampling_param_exclude_input_from_output": True}
    assert _generate(server, alone)["text_output"] == completion
    # greedy by the LLM API's rules: top_k 1 wins over a temperature
    top_1 = _generate(server, {**alone, "sampling_param_temperature": 0.7, "sampling_param_top_k": 1})
    assert top_1["text_output"] == completion
    # upstream's default (serving.exclude_input_in_output=false): the prompt, then the completion
    echoed = _generate(server, {**body, "return_finish_reason": True, "return_stop_reason": True})
    assert echoed["text_output"] == _text(encoder, encoder.encode_prompt(prompt) + hf_greedy[prompt])
    length = len(hf_greedy[prompt]) == MAX_TOKENS
    assert (echoed["finish_reason"], echoed["stop_reason"]) == ("length" if length else "stop", "None")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_grows_to_hf_greedy_text(
    server: TritonServer, encoder: PromptEncoder, hf_greedy: dict, prompt: str
) -> None:
    responses = _stream(
        server,
        text_input=prompt,
        streaming=True,
        sampling_param_max_tokens=MAX_TOKENS,
        sampling_param_top_p=0.0,  # greedy, the LLM API's way
        sampling_param_frequency_penalty=0.0,
        sampling_param_presence_penalty=0.0,
        return_finish_reason=True,
        return_cumulative_logprob=True,
    )
    texts = [_string(r, "text_output") for r in responses]
    assert len(texts) > 1 and texts[-1] == _text(encoder, hf_greedy[prompt])
    # each response carries the text so far, as the LLM API's CompletionOutput.text does
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    reasons = [_string(r, "finish_reason") for r in responses]
    assert set(reasons[:-1]) == {"None"} and reasons[-1] in ("length", "stop")
    logprobs = [float(r["cumulative_logprob"][0]) for r in responses]
    assert logprobs[-1] < 0 and logprobs == sorted(logprobs, reverse=True)


def _stop_word(encoder: PromptEncoder, output_ids: list[int]) -> tuple[str, int]:
    """A one-token stop string first generated at index k >= 2 of `output_ids`, and k."""
    for k, token in enumerate(output_ids):
        word = _text(encoder, [token])
        if k >= 2 and token not in output_ids[:k] and word.strip() and encoder.encode_word(word) == (token,):
            return word, k
    raise AssertionError(f"no usable stop string in {output_ids}")


def test_stop_string_ends_the_text_before_it(
    server: TritonServer, encoder: PromptEncoder, hf_greedy: dict
) -> None:
    prompt = PROMPTS[0]
    word, k = _stop_word(encoder, hf_greedy[prompt])
    body = {
        "text_input": prompt,
        "sampling_param_max_tokens": MAX_TOKENS,
        "sampling_param_stop": ["never generated \u2603", word],
        "sampling_param_exclude_input_from_output": True,
        "return_finish_reason": True,
        "return_stop_reason": True,
    }
    reply = _generate(server, body)
    want = _text(encoder, hf_greedy[prompt][:k])
    assert (reply["text_output"], reply["finish_reason"], reply["stop_reason"]) == (want, "stop", word)
    streamed = _stream(server, streaming=True, **body)
    assert _string(streamed[-1], "text_output") == want and _string(streamed[-1], "stop_reason") == word


def _counts(server: TritonServer) -> tuple[float, float, float]:
    """(aborted requests, generated tokens, KV blocks in use) of the llmapi model."""
    values = scrape_metrics(server.metrics_url)
    return (
        metric(values, "llmpipe_requests_finished_total", model="tensorrt_llm", finish_reason="abort"),
        metric(values, "llmpipe_generated_tokens_total", model="tensorrt_llm"),
        metric(values, "nv_trt_llm_kv_cache_block_metrics", model="tensorrt_llm", kv_cache_block_type="used"),
    )


def _wait_for(predicate: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_cancelled_stream_frees_its_kv_blocks(server: TritonServer) -> None:
    aborts, tokens, _ = _counts(server)
    stream = Stream(server)
    try:
        stream.send(text_input="Tell me a long story", streaming=True, sampling_param_max_tokens=LONG)
        assert len(stream.responses(limit=2)) == 2
        assert _wait_for(lambda: _counts(server)[2] > 0)  # the request holds blocks while it runs
    finally:
        stream.close(cancel=True)  # what a client that goes away does

    def freed() -> bool:
        now = _counts(server)
        return now[0] >= aborts + 1 and now[2] == 0

    assert _wait_for(freed), _counts(server)
    assert _counts(server)[1] - tokens < LONG  # it stopped far short of its max_tokens


def test_stop_input_cancels_the_request_with_that_id(server: TritonServer) -> None:
    aborts = _counts(server)[0]
    victim, stopper = Stream(server), Stream(server)
    request_id = f"victim-{uuid.uuid4().hex[:8]}"
    try:
        victim.send(
            request_id,
            text_input="Tell me a long story",
            streaming=True,
            sampling_param_max_tokens=LONG,
            return_finish_reason=True,
        )
        assert len(victim.responses(limit=2)) == 2
        stopper.send(request_id, text_input="", stop=True)
        assert [_string(r, "text_output") for r in stopper.responses()] == [""]
        rest = victim.responses()
    finally:
        victim.close()
        stopper.close()
    assert _string(rest[-1], "finish_reason") == "cancelled"
    assert _wait_for(lambda: _counts(server)[0] >= aborts + 1 and _counts(server)[2] == 0)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"image_url": ["https://example.com/cat.png"]}, "input 'image_url'"),
        ({"lora_id": 3, "lora_name": "a", "lora_path": "/a"}, "input 'lora_id'"),
        ({"sampling_param_best_of": 2}, "input 'sampling_param_best_of'=2"),
        ({"sampling_param_max_tokens": 5000}, "input 'sampling_param_max_tokens'=5000"),
        ({"sampling_param_top_p": 1.5}, "input 'sampling_param_top_p'=1.5"),
    ],
)
def test_inputs_the_engine_cannot_honour_are_refused_by_name(
    server: TritonServer, extra: dict, named: str
) -> None:
    reply = _generate(server, {"text_input": "hello", "sampling_param_max_tokens": 4, **extra})
    assert reply.get("status") == 400 and named in reply["error"], reply
    # the defaults pass: best_of 1, an empty image list
    assert "text_output" in _generate(
        server,
        {"text_input": "hello", "sampling_param_best_of": 1, "image_url": [], "sampling_param_max_tokens": 2},
    )


@pytest.fixture(scope="module")
def unary(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """serving.decoupled=false: model.yaml's triton_config.decoupled is false, and Triton applies it."""
    repo = tmp_path_factory.mktemp("llmapi-unary") / "model_repo"
    with serve_tiny(
        tiny_llama_dir, tiny_engine_dir, repo, decoupled=False, serving={"interface": "llmapi"}
    ) as srv:
        yield srv


def test_a_non_decoupled_deployment_answers_unary_calls(
    unary: TritonServer, encoder: PromptEncoder, hf_greedy: dict
) -> None:
    import tritonclient.grpc as grpcclient

    prompt = PROMPTS[0]
    client = grpcclient.InferenceServerClient(unary.grpc_url)
    try:
        assert not client.get_model_config("tensorrt_llm").config.model_transaction_policy.decoupled
        inputs = []
        for name, array, datatype in (
            ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            ("sampling_param_max_tokens", np.array([MAX_TOKENS], dtype=np.int32), "INT32"),
            ("sampling_param_exclude_input_from_output", np.array([True]), "BOOL"),
        ):
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("tensorrt_llm", inputs)
    finally:
        client.close()
    assert _string({"text_output": result.as_numpy("text_output")}, "text_output") == _text(
        encoder, hf_greedy[prompt]
    )
    refused = _generate(unary, {"text_input": prompt, "streaming": True})
    assert refused.get("status") == 400 and "input 'streaming'=True" in refused["error"], refused
