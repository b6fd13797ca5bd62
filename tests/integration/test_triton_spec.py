"""A REAL tritonserver serving the tiny model built with prompt lookup (speculative.mode=ngram): outputs equal
decoding without speculation through tensorrt_llm, the ensemble and the BLS; TensorRT-LLM's acceptance
outputs come back when a request sets return_perf_metrics (equal to what the engine counts in-process)
and not otherwise; the speculative-decoding metric families count them on :8002. One server."""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import EngineArgs, SpeculationArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.spec_decode.metrics import spec_decode_stats
from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import build_tiny_engine, metric, require_tritonserver, scrape_metrics, serve_tiny

pytestmark = pytest.mark.triton
NGRAM = {"mode": "ngram", "max_draft_len": 4, "ngram": {"min_match": 1, "max_match": 3}}
# Token ids whose greedy continuation by the tiny model repeats some of them: prompt lookup drafts.
ID_PROMPT = [1133, 1885, 38, 201, 1483, 1730, 1710, 1798, 226, 497, 289, 968, 483, 1596, 1681, 64, 21, 1303]
NUM_TOKENS = 64
TEXT_PROMPT = "a b c d a b c d a b c d"
TEXT_TOKENS = 24


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tritonserver()
    return build_tiny_engine(tiny_llama_dir, tmp_path_factory.mktemp("spec-engine"), speculative=NGRAM)


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    repo = tmp_path_factory.mktemp("spec-repo") / "model_repo"
    with serve_tiny(tiny_llama_dir, engine_dir, repo, speculative=NGRAM) as server:
        yield server
        assert server.stop() == 0
        assert server.leftover_shm() == []


@pytest.fixture(scope="module")
def engines(engine_dir: Path) -> dict[str, LLMEngine]:
    """The same engine in-process: as built (prompt lookup) and without speculation."""
    return {
        "spec": LLMEngine.from_engine_dir(engine_dir),
        "plain": LLMEngine.from_engine_dir(engine_dir, EngineArgs(speculation=SpeculationArgs(mode="none"))),
    }


def _grpc_engine_stream(server: TritonServer, **extra: Any) -> list[Any]:
    """tensorrt_llm over a gRPC stream, token ids in and out; the responses in order."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    client.start_stream(callback=lambda result=None, error=None: results.put((result, error)))
    tensors = {
        "input_ids": np.array([ID_PROMPT], np.int32),
        "input_lengths": np.array([[len(ID_PROMPT)]], np.int32),
        "request_output_len": np.array([[NUM_TOKENS]], np.int32),
        "streaming": np.array([[True]]),
        **{name: np.array([[value]]) for name, value in extra.items()},
    }
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    responses = []
    try:
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                responses.append(result)
            if response.parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _http(server: TritonServer, model: str, body: dict[str, Any], stream: bool = False) -> list[dict]:
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        text = reply.read().decode()
    if not stream:
        return [json.loads(text)]
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def _acceptance(outputs: dict[str, Any]) -> tuple[float, int, int]:
    """(acceptance_rate, total_accepted_draft_tokens, total_draft_tokens), checked for consistency."""
    rate, accepted, drafted = (
        np.asarray(outputs[name]).reshape(-1)[0].item()
        for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
    )
    assert 0.0 <= rate <= 1.0 and 0 <= accepted <= drafted
    assert rate == pytest.approx(accepted / drafted if drafted else 0.0)
    return rate, accepted, drafted


def test_engine_stream_equals_plain_decoding_and_reports_the_engines_drafts(
    server: TritonServer, engines: dict[str, LLMEngine]
) -> None:
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0)
    plain = engines["plain"].generate([ID_PROMPT], greedy)[0]
    spec = engines["spec"].generate([ID_PROMPT], greedy)[0]
    expected = spec_decode_stats(spec.stats, spec.num_output_tokens)
    assert spec.output_token_ids == plain.output_token_ids and expected.num_draft_tokens > 0

    before = scrape_metrics(server.metrics_url)
    responses = _grpc_engine_stream(server, return_perf_metrics=True)
    tokens = [t for r in responses for t in r.as_numpy("output_ids").reshape(-1).tolist()]
    assert tokens == plain.output_token_ids
    assert all(r.as_numpy("acceptance_rate") is None for r in responses[:-1])  # the final response only
    names = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
    _, accepted, drafted = _acceptance({name: responses[-1].as_numpy(name) for name in names})
    assert (drafted, accepted) == (expected.num_draft_tokens, expected.num_accepted_draft_tokens)

    # Counted when the request finished, before its last response went out.
    after = scrape_metrics(server.metrics_url)

    def delta(family: str, **labels: str) -> float:
        return metric(after, family, **labels) - metric(before, family, **labels)

    assert delta("llmpipe_spec_decode_tokens_total", token_type="draft") == drafted
    assert delta("llmpipe_spec_decode_tokens_total", token_type="accepted") == accepted
    assert delta("llmpipe_spec_decode_steps_total") == expected.num_decode_steps > 0
    assert 0.0 <= metric(after, "llmpipe_spec_decode_acceptance_rate") <= 1.0


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_ensemble_and_bls_pass_the_acceptance_outputs_on(
    server: TritonServer, engines: dict[str, LLMEngine], engine_dir: Path, model: str
) -> None:
    encoder = PromptEncoder.from_dir(engine_dir / "tokenizer")
    greedy = SamplingParams(max_tokens=TEXT_TOKENS, temperature=0.0, end_id=encoder.end_id)
    plain = engines["plain"].generate([encoder.encode_prompt(TEXT_PROMPT)], greedy)[0]
    expected = encoder.tokenizer.decode(plain.output_token_ids, skip_special_tokens=True)
    body = {"text_input": TEXT_PROMPT, "max_tokens": TEXT_TOKENS, "exclude_input_in_output": True}

    (whole,) = _http(server, model, {**body, "return_perf_metrics": True})
    assert whole["text_output"] == expected
    _acceptance(whole)
    streamed = _http(server, model, {**body, "stream": True, "return_perf_metrics": True}, stream=True)
    assert "".join(event["text_output"] for event in streamed) == expected
    _acceptance(streamed[-1])
    (silent,) = _http(server, model, body)
    assert silent["text_output"] == expected and "acceptance_rate" not in silent


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bench_clients_count_every_token_and_read_the_drafts(server: TritonServer, protocol: str) -> None:
    from pipeline.bench.clients.triton import EnsembleCounting, triton_target
    from pipeline.bench.load import run_closed_loop
    from pipeline.bench.requests import BenchRequest

    url = f"{protocol}://{server.grpc_url if protocol == 'grpc' else server.http_url}"
    # counted exactly, by the log-probs (`llmpipe bench --log-probs`)
    target = triton_target(
        url, "ensemble", min_tokens_equal_max=True, counting=EnsembleCounting(log_probs=True)
    )
    requests = [BenchRequest(index=i, output_tokens=32, prompt=f"{TEXT_PROMPT} {i}") for i in range(2)]
    try:
        result = run_closed_loop(target, requests, concurrency=2)
    finally:
        target.close()
    # Speculative steps stream several tokens per response: the counts still add up to the forced length.
    assert all(r.ok and r.num_output_tokens == 32 for r in result.records), result.records
    assert all(r.drafts is not None for r in result.records)
    metrics = result.metrics()
    drafted = sum(r.drafts.num_draft_tokens for r in result.records if r.drafts)
    assert (metrics.acceptance_rate is None) == (drafted == 0)
