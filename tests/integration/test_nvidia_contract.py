"""The tensors NVIDIA's own tensorrtllm_backend clients send (v0.18.0: inflight_batcher_llm_client.py,
end_to_end_grpc_client.py, tools/inflight_batcher_llm/end_to_end_test.py and benchmark_core_model.py),
sent here with our own tritonclient code to a real tritonserver, checked for upstream's shapes and for
token parity with Hugging Face greedy decoding.

Sources of the tensors: triton-inference-server/tensorrtllm_backend@86542b6 (tag v0.18.0), the scripts'
request builders; a decoupled deployment for the streaming clients, a non-decoupled one for the unary
ones, as their README pairs them."""

from __future__ import annotations

import queue
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import serve_tiny

pytestmark = pytest.mark.triton
PROMPT = "Born in north-east France, Soyer trained as a"
OUTPUT_LEN = 12


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir: Path, tokenizer: Any) -> Any:
    """prompt ids, new tokens -> Hugging Face's greedy continuation (no end id: always `new` tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def generate(ids: list[int], new: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return out[0, len(ids) :].tolist()

    return generate


@pytest.fixture(scope="module")
def unary(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    repo = tmp_path_factory.mktemp("nvidia-unary") / "model_repo"
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, repo, decoupled=False) as server:
        yield server


def _tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    tensor.set_data_from_numpy(value)
    return tensor


def _inputs(**values: np.ndarray) -> list[grpcclient.InferInput]:
    return [_tensor(name, value) for name, value in values.items()]


def _stream(url: str, model: str, inputs: list[grpcclient.InferInput], request_id: str = "1") -> list[Any]:
    """Every response of one request over the gRPC stream, as the clients read them (final included)."""
    responses: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put(error or result))
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        out = []
        while True:
            item = responses.get(timeout=60)
            if isinstance(item, InferenceServerException):
                raise item
            final = item.get_response().parameters.get("triton_final_response")
            if item.get_response().outputs:
                out.append(item)
            if final is not None and final.bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def _ensemble_inputs(prompt: str, **extra: np.ndarray) -> list[grpcclient.InferInput]:
    # end_to_end_grpc_client.py's tensors for its default command line (-p PROMPT -o OUTPUT_LEN)
    return _inputs(
        text_input=np.array([[prompt.encode()]], dtype=object),
        max_tokens=np.array([[OUTPUT_LEN]], dtype=np.int32),
        stream=np.array([[extra.pop("stream", False)]], dtype=bool),
        beam_width=np.array([[1]], dtype=np.int32),
        temperature=np.array([[1.0]], dtype=np.float32),
        exclude_input_in_output=np.array([[extra.pop("exclude", False)]], dtype=bool),
        **extra,
    )


def _engine_inputs(ids: list[int], tokenizer: Any, streaming: bool) -> dict[str, np.ndarray]:
    # inflight_batcher_llm_client.py's tensors for its default command line
    end = tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)[0]
    return {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[OUTPUT_LEN]], dtype=np.int32),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "streaming": np.array([[streaming]], dtype=bool),
        "end_id": np.array([[end]], dtype=np.int32),
        "pad_id": np.array([[end]], dtype=np.int32),
        "runtime_top_k": np.array([[1]], dtype=np.int32),
        "runtime_top_p": np.array([[0.0]], dtype=np.float32),
    }


def test_end_to_end_grpc_client_gets_the_prompt_and_hf_greedy_text(
    tiny_server: TritonServer, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    expected = tokenizer.decode(ids + hf_greedy(ids, OUTPUT_LEN), skip_special_tokens=True)
    (response,) = _stream(tiny_server.grpc_url, "ensemble", _ensemble_inputs(PROMPT))
    text_output = response.as_numpy("text_output")
    assert text_output.shape == (1,) and text_output[0].decode("utf-8") == expected  # flat, echoed
    assert response.as_numpy("cum_log_probs") is None and response.as_numpy("batch_index") is None


def test_streamed_deltas_add_up_to_the_hf_greedy_answer(
    tiny_server: TritonServer, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    expected = tokenizer.decode(hf_greedy(ids, OUTPUT_LEN), skip_special_tokens=True)
    for model in ("ensemble", "tensorrt_llm_bls"):
        responses = _stream(tiny_server.grpc_url, model, _ensemble_inputs(PROMPT, stream=True))
        assert len(responses) > 1
        assert "".join(r.as_numpy("text_output")[0].decode() for r in responses) == expected


def test_upstream_names_and_log_probs_are_honoured(tiny_server: TritonServer, tokenizer: Any) -> None:
    extra = {
        "min_length": np.array([[OUTPUT_LEN]], dtype=np.int32),  # genai-perf's deterministic lengths
        "random_seed": np.array([[7]], dtype=np.uint64),
        "return_log_probs": np.array([[True]], dtype=bool),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "return_context_logits": np.array([[False]], dtype=bool),
        "return_generation_logits": np.array([[False]], dtype=bool),
        "stop_words": np.array([[b"zzz"]], dtype=object),
        "bad_words": np.array([[b"qqq"]], dtype=object),
        "embedding_bias_words": np.array([[b" the"]], dtype=object),
        "embedding_bias_weights": np.array([[0.0]], dtype=np.float32),
    }
    (response,) = _stream(tiny_server.grpc_url, "ensemble", _ensemble_inputs(PROMPT, exclude=True, **extra))
    assert response.as_numpy("output_log_probs").shape == (1, 1, OUTPUT_LEN)
    assert response.as_numpy("cum_log_probs").item() == pytest.approx(
        float(response.as_numpy("output_log_probs").sum()), abs=1e-3
    )


def test_more_than_the_torch_engine_does_is_a_client_error_naming_the_input(
    tiny_server: TritonServer,
) -> None:
    inputs = [i for i in _ensemble_inputs(PROMPT) if i.name() != "beam_width"]
    inputs += _inputs(beam_width=np.array([[4]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="input 'beam_width'=4: .*no beam search"):
        _stream(tiny_server.grpc_url, "ensemble", inputs)


def test_embedding_bias_words_steer_every_token(tiny_server: TritonServer, tokenizer: Any) -> None:
    # end_to_end_grpc_client.py --embedding-bias-words " Paris" --embedding-bias-weights 2.0, with a weight
    # large enough that the biased token wins every step
    word = tokenizer.encode(" Paris", add_special_tokens=False)
    extra = {
        "embedding_bias_words": np.array([[b" Paris"]], dtype=object),
        "embedding_bias_weights": np.array([[1000.0]], dtype=np.float32),
    }
    (response,) = _stream(tiny_server.grpc_url, "ensemble", _ensemble_inputs(PROMPT, exclude=True, **extra))
    pieces = "|".join(re.escape(tokenizer.decode([token])) for token in word)
    assert re.fullmatch(f"({pieces})+", response.as_numpy("text_output")[0].decode())


def test_batch_inputs_come_back_per_row_with_batch_index(
    tiny_server: TritonServer, tokenizer: Any, hf_greedy: Any
) -> None:
    prompts = [PROMPT, "My name is"]
    inputs = _inputs(
        text_input=np.array([[p.encode()] for p in prompts], dtype=object),
        max_tokens=np.array([[OUTPUT_LEN]] * 2, dtype=np.int32),
        exclude_input_in_output=np.array([[True]] * 2, dtype=bool),
    )
    texts: dict[int, str] = {}
    for response in _stream(tiny_server.grpc_url, "ensemble", inputs):
        texts[int(response.as_numpy("batch_index")[0][0])] = response.as_numpy("text_output")[0].decode()
    expected = {
        i: tokenizer.decode(hf_greedy(tokenizer.encode(p), OUTPUT_LEN), skip_special_tokens=True)
        for i, p in enumerate(prompts)
    }
    assert texts == expected


def test_inflight_batcher_client_streams_hf_greedy_tokens(
    tiny_server: TritonServer, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    inputs = _inputs(**_engine_inputs(ids, tokenizer, streaming=True))
    tokens = []
    for response in _stream(tiny_server.grpc_url, "tensorrt_llm", inputs):
        output_ids = response.as_numpy("output_ids")
        assert output_ids.ndim == 3 and output_ids.shape[:2] == (1, 1)
        tokens += output_ids[0][0][: response.as_numpy("sequence_length")[0][0]].tolist()
    assert tokens == hf_greedy(ids, OUTPUT_LEN)


def test_unary_clients_get_the_prompt_then_hf_greedy_tokens(
    unary: TritonServer, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    client = grpcclient.InferenceServerClient(unary.grpc_url)
    result = client.infer("tensorrt_llm", _inputs(**_engine_inputs(ids, tokenizer, streaming=False)))
    output_ids = result.as_numpy("output_ids")
    # benchmark_core_model.py reads the first output's shape[2]: output_ids, [1, beam, len]
    assert result.get_response(as_json=True)["outputs"][0]["name"] == "output_ids"
    seq_len = result.as_numpy("sequence_length")[0][0]
    assert output_ids[0][0][:seq_len].tolist() == ids + hf_greedy(ids, OUTPUT_LEN)
    with pytest.raises(InferenceServerException, match="not decoupled"):
        client.infer("tensorrt_llm", _inputs(**_engine_inputs(ids, tokenizer, streaming=True)))


def test_end_to_end_test_chain_equals_the_ensemble(unary: TritonServer) -> None:
    # tools/inflight_batcher_llm/end_to_end_test.py: preprocessing -> tensorrt_llm -> postprocessing by hand,
    # each a unary call, must give the ensemble's text_output.
    client = grpcclient.InferenceServerClient(unary.grpc_url)
    query = np.array([[PROMPT.encode()]], dtype=object)
    empty_words = np.array([[b""]], dtype=object)
    pre = client.infer(
        "preprocessing",
        _inputs(
            QUERY=query,
            BAD_WORDS_DICT=empty_words,
            STOP_WORDS_DICT=empty_words,
            REQUEST_OUTPUT_LEN=np.array([[OUTPUT_LEN]], dtype=np.int32),
        ),
    )
    assert pre.as_numpy("DECODER_INPUT_ID").shape == (1, 1)
    engine = client.infer(
        "tensorrt_llm",
        _inputs(
            input_ids=pre.as_numpy("INPUT_ID"),
            decoder_input_ids=pre.as_numpy("DECODER_INPUT_ID"),
            input_lengths=pre.as_numpy("REQUEST_INPUT_LEN"),
            request_output_len=pre.as_numpy("REQUEST_OUTPUT_LEN"),
            end_id=pre.as_numpy("OUT_END_ID"),
            pad_id=pre.as_numpy("OUT_PAD_ID"),
        ),
    )
    post = client.infer(
        "postprocessing",
        _inputs(
            TOKENS_BATCH=engine.as_numpy("output_ids").astype(np.int32),
            SEQUENCE_LENGTH=engine.as_numpy("sequence_length"),
        ),
    )
    ensemble = client.infer(
        "ensemble",
        _inputs(
            text_input=query,
            max_tokens=np.array([[OUTPUT_LEN]], dtype=np.int32),
            bad_words=empty_words,
            stop_words=empty_words,
        ),
    )
    assert post.as_numpy("OUTPUT").tolist() == ensemble.as_numpy("text_output").tolist()
    assert ensemble.as_numpy("text_output").shape == (1,)
