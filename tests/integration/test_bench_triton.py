"""The Triton targets of `llmpipe bench` against a real tritonserver serving a stand-in decoupled `ensemble`
(Python backend): gRPC streaming and HTTP SSE, token counts, timing, the min_tokens/top_k the client sends,
and server-side errors recorded per request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipeline.bench.clients.triton import EnsembleCounting, triton_target
from pipeline.bench.load import run_closed_loop
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError
from pipeline.serving.server.command import ServerOptions
from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import require_tritonserver

pytestmark = pytest.mark.triton

CONFIG = """
name: "ensemble"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "min_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# Streams max_tokens responses 10 ms apart after 50 ms (prompts saying "pairs": half as many, each with
# two words, as a speculative step's); refuses requests that do not force their length greedily
# (min_tokens == max_tokens, top_k == 1), and prompts saying "fail".
MODEL = """
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        max_tokens = int(_scalar(request, "max_tokens"))
        prompt = _scalar(request, "text_input").decode()
        if _scalar(request, "min_tokens") != max_tokens or _scalar(request, "top_k") != 1 or "fail" in prompt:
            error = pb_utils.TritonError(f"refused: {prompt}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        time.sleep(0.05)
        pieces = [b" tok tok"] * (max_tokens // 2) if "pairs" in prompt else [b"tok"] * max_tokens
        for piece in pieces:
            out = pb_utils.Tensor("text_output", np.array([piece], dtype=object))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    require_tritonserver()
    repo = tmp_path_factory.mktemp("bench-repo")
    (repo / "ensemble" / "1").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(CONFIG)
    (repo / "ensemble" / "1" / "model.py").write_text(MODEL)
    with TritonServer(ServerOptions(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0)) as srv:
        yield srv


def _requests(count: int, prompt: str = "hello") -> list[BenchRequest]:
    return [
        BenchRequest(index=i, output_tokens=4 + i % 3, prompt=prompt, input_ids=(1, 2)) for i in range(count)
    ]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streams_are_timed_per_response(server: TritonServer, protocol: str) -> None:
    url = f"grpc://{server.grpc_url}" if protocol == "grpc" else f"http://{server.http_url}"
    target = triton_target(url)
    try:
        result = run_closed_loop(target, _requests(6), concurrency=3)
    finally:
        target.close()
    m = result.metrics()
    assert m.num_errors == 0 and m.num_short_outputs == 0
    assert m.total_output_tokens == sum(4 + i % 3 for i in range(6))
    assert m.ttft_s is not None and 0.05 <= m.ttft_s.p50 < 0.5
    assert m.itl_s is not None and 0.005 <= m.itl_s.p50 < 0.1


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_responses_of_several_tokens_are_counted_by_their_text(
    server: TritonServer, protocol: str, tiny_llama_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    per_response = len(tokenizer(" tok tok", add_special_tokens=False)["input_ids"])
    assert per_response > 1
    url = f"grpc://{server.grpc_url}" if protocol == "grpc" else f"http://{server.http_url}"
    target = triton_target(url, counting=EnsembleCounting(tokenizer=tokenizer))
    try:
        result = run_closed_loop(target, _requests(2, prompt="pairs please"), concurrency=2)
    finally:
        target.close()
    for record in result.records:
        assert record.error is None
        assert record.response_tokens == [per_response] * (record.num_expected_tokens // 2)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_server_errors_become_request_errors(server: TritonServer, protocol: str) -> None:
    url = f"grpc://{server.grpc_url}" if protocol == "grpc" else f"http://{server.http_url}"
    target = triton_target(url)
    try:
        failed = run_closed_loop(target, _requests(2, prompt="please fail"), concurrency=1)
        after = run_closed_loop(target, _requests(2), concurrency=1)  # the same stream keeps working
    finally:
        target.close()
    assert all(r.error and "refused: please fail" in r.error for r in failed.records)
    assert after.metrics().num_errors == 0


def test_without_forced_lengths_the_stand_in_refuses(server: TritonServer) -> None:
    target = triton_target(f"grpc://{server.grpc_url}", min_tokens_equal_max=False)
    try:
        result = run_closed_loop(target, _requests(1), concurrency=1)
    finally:
        target.close()
    assert result.metrics().num_errors == 1


def test_unknown_model_is_a_serving_error(server: TritonServer) -> None:
    with pytest.raises(ServingError, match="not ready|not available"):
        triton_target(f"grpc://{server.grpc_url}", model="tensorrt_llm")
