"""Every supported architecture through a REAL tritonserver (Triton 2.51): the tiny checkpoint's repository
answers gRPC streams on the ensemble and the BLS model, and HTTP generate, with Hugging Face's greedy text for
prompts longer than its attention windows. Three families in the default suite; every one under `slow`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline.serving.client import GenerationOptions, GrpcClient, HttpClient
from pipeline.serving.server.launcher import TritonServer
from pipeline.serving.triton_models.tokenization import PromptEncoder
from pipeline.sources.tiny import ARCHITECTURES, make_tiny_checkpoint
from tests.integration.test_parity import hf_greedy, make_engine_dir
from tests.serving_helpers import serve_tiny

pytestmark = pytest.mark.triton
MAX_TOKENS = 24
PROMPTS = (
    "def main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n" * 3,
    "The quick brown fox",
)
# Sparse MoE, per-layer windows + local RoPE + q/k norms (Gemma 3), partial rotary + LongRoPE (Phi-3).
DEFAULT_SUITE = ("qwen3-moe", "gemma3", "phi3")
CASES = [
    pytest.param(name, marks=() if name in DEFAULT_SUITE else pytest.mark.slow)
    for name in ARCHITECTURES
    if name not in ("llama",)  # test_triton.py serves the tiny Llama
]


@pytest.fixture(scope="module", params=CASES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TritonServer, dict[str, str]]]:
    """(the server, prompt -> Hugging Face's greedy completion text)."""
    root = tmp_path_factory.mktemp(f"triton-{request.param}")
    hf_dir = root / "hf"
    make_tiny_checkpoint(hf_dir, arch=request.param, seed=0)
    engine_dir = make_engine_dir(hf_dir, root)
    encoder = PromptEncoder.from_dir(engine_dir / "tokenizer")
    ids = [encoder.encode_prompt(p) for p in PROMPTS]
    assert len(ids[0]) > 24, "the long prompt must outgrow the tiny models' windows"
    reference, _ = hf_greedy(hf_dir, ids, [MAX_TOKENS] * len(ids))
    expected = {
        prompt: encoder.tokenizer.decode(tokens, skip_special_tokens=True)
        for prompt, tokens in zip(PROMPTS, reference, strict=True)
    }
    with serve_tiny(hf_dir, engine_dir, root / "model_repo") as server:
        yield server, expected


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_streams_equal_hugging_face(served: tuple[TritonServer, dict[str, str]], model: str) -> None:
    server, expected = served
    with GrpcClient(server.grpc_url, model) as client:
        for prompt, want in expected.items():
            assert client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True)).text == want


def test_http_generate_equals_hugging_face(served: tuple[TritonServer, dict[str, str]]) -> None:
    server, expected = served
    http = HttpClient(server.http_url)
    for prompt, want in expected.items():
        assert http.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS)).text == want
