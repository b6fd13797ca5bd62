"""Gemma 3 270M (base; real weights, dequantized from the Q4_K_M GGUF that fetch finds for
build_configs/gemma3-270m.yaml) through the torch engine built from that config: greedy tokens equal HF
transformers fp32 token for token and the chosen tokens' log-probs agree, on real-text prompts below and
beyond the 512-token sliding window, with chunked context splitting the long ones; and one request through
a real tritonserver equals the in-process greedy text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import SchedulerConfig
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.worker.model_runner import ModelRunner
from pipeline.util.package_data import DATA_DIR
from tests.fixtures_models import GEMMA3_CONFIG
from tests.integration.test_parity import model_greedy
from tests.serving_helpers import require_tritonserver

pytestmark = pytest.mark.slow

SLIDING_WINDOW = 512
# Prompt lengths in tokens (BOS included): two inside the sliding window, two well past it. Past it the
# window matters: HF with full attention in every layer moves next-token log-probs of the 1000-token
# prompt by up to ~30 nats (argmax changes at 345 of its 488 positions beyond 512).
PROMPT_TOKENS = (180, 450, 700, 1000)
MAX_TOKENS = 24
# Both sides compute in fp32, in different summation orders (fused kernels, paged attention, chunking):
# chosen tokens' log-probs measured within 8e-6 of HF's on these prompts at step budgets 96, 200 and 512.
LOGPROB_TOLERANCE = 1e-4
# A step budget that is neither a multiple of the KV block (32) nor a divisor of the window, so chunk
# boundaries fall mid-block and mid-window.
CHUNK_BUDGET = 200
SERVED_PROMPT = "The three primary colors are"
SERVED_MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cfg() -> BuildConfig:
    return load_build_config(GEMMA3_CONFIG)


@pytest.fixture(scope="module")
def engine_dir(cfg: BuildConfig, gemma3_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """convert + build of the torch backend with the config's own engine limits."""
    from pipeline.backends.torch.build import build
    from pipeline.backends.torch.checkpoint import convert

    root = tmp_path_factory.mktemp("gemma3-engine")
    convert(cfg, gemma3_hf_dir, root / "checkpoint")
    build(cfg, root / "checkpoint", root / "engine")
    return root / "engine"


@pytest.fixture(scope="module")
def hf_model(gemma3_hf_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(gemma3_hf_dir: Path) -> list[list[int]]:
    """BOS + held-out English text, each prompt from its own offset (no shared prefix beyond BOS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_dir)
    text = (DATA_DIR / "eval" / "heldout.txt").read_text("utf-8")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) >= max(PROMPT_TOKENS) + 300, f"held-out text has only {len(ids)} tokens"
    bos = tokenizer.bos_token_id
    return [[bos, *ids[97 * i : 97 * i + n - 1]] for i, n in enumerate(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def reference(hf_model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """HF fp32 greedy continuations and their log-probs (MAX_TOKENS each; the base model rarely stops)."""
    return model_greedy(hf_model, prompts, [MAX_TOKENS] * len(prompts))


@pytest.fixture(scope="module")
def runner(engine_dir: Path) -> ModelRunner:
    return ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu"))


def run_engine(
    runner: ModelRunner,
    cfg: BuildConfig,
    prompts: list[list[int]],
    eos_id: int,
    logprobs: bool,
    max_num_tokens: int,
) -> list[Request]:
    config = SchedulerConfig(
        max_batch_size=cfg.engine.max_batch_size,
        max_num_tokens=max_num_tokens,
        max_input_len=cfg.engine.max_input_len,
        max_seq_len=cfg.engine.max_seq_len,
        enable_chunked_context=True,
        enable_block_reuse=cfg.kv_cache.enable_block_reuse,
    )
    engine = LLMEngine(runner, config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, end_id=eos_id, logprobs=logprobs)
    return engine.generate(prompts, [params] * len(prompts))


def test_prompts_cross_the_sliding_window(runner: ModelRunner, prompts: list[list[int]]) -> None:
    model = runner.config.model
    assert model.sliding_window == SLIDING_WINDOW
    assert model.layer_types is not None and model.layer_types.count("full_attention") == 3
    assert sum(len(p) > SLIDING_WINDOW for p in prompts) == 2


@pytest.mark.parametrize(
    ("logprobs", "budget"),
    [(True, CHUNK_BUDGET), (False, None)],
    ids=["logprobs-chunked-200", "greedy-head-config-budget"],
)
def test_greedy_parity_with_hf(
    runner: ModelRunner,
    hf_model: Any,
    cfg: BuildConfig,
    prompts: list[list[int]],
    reference: tuple[list[list[int]], list[list[float]]],
    logprobs: bool,
    budget: int | None,
) -> None:
    """All prompts at once, chunked context on: with logprobs at a 200-token step budget; without (the
    int8-screened greedy lm_head, what serving uses) at the config's own budget (512)."""
    eos_id = hf_model.config.eos_token_id
    requests = run_engine(runner, cfg, prompts, eos_id, logprobs, budget or cfg.engine.max_num_tokens)
    ref_tokens, ref_logprobs = reference
    for i, request in enumerate(requests):
        where = f"prompt {i} ({len(prompts[i])} tokens)"
        got, want = request.output_token_ids, ref_tokens[i]
        first = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        assert got == want, f"{where}: first differing output token at {first}: engine {got} vs HF {want}"
        if logprobs:
            worst = max(abs(a - b) for a, b in zip(request.output_logprobs, ref_logprobs[i], strict=True))
            assert worst < LOGPROB_TOLERANCE, f"{where}: a log-prob differs from HF's by {worst:.2e}"


@pytest.fixture(scope="module")
def served(cfg: BuildConfig, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real tritonserver on free loopback ports serving the engine packaged with the config; its HTTP URL."""
    from pipeline.serving.repository.render import render_model_repository
    from pipeline.serving.server.command import ServerOptions
    from pipeline.serving.server.launcher import TritonServer

    require_tritonserver()
    repo = tmp_path_factory.mktemp("gemma3-serving") / "model_repo"
    render_model_repository(cfg, engine_dir, repo)
    options = ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=30)
    with TritonServer(options, ready_timeout_s=300) as server:
        yield server.http_url


def test_triton_request_equals_in_process_greedy(runner: ModelRunner, engine_dir: Path, served: str) -> None:
    from pipeline.serving.client import GenerationOptions, HttpClient
    from pipeline.serving.triton_models.tokenization import PromptEncoder

    encoder = PromptEncoder.from_dir(engine_dir / "tokenizer")
    engine = LLMEngine(runner, SchedulerConfig(max_input_len=1024, max_seq_len=2048))
    params = SamplingParams(max_tokens=SERVED_MAX_TOKENS, temperature=0.0, end_id=encoder.end_id)
    (request,) = engine.generate([encoder.encode_prompt(SERVED_PROMPT)], [params])
    want = encoder.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    assert want.strip(), "the in-process engine generated only special tokens"
    got = HttpClient(served).generate(SERVED_PROMPT, GenerationOptions(max_tokens=SERVED_MAX_TOKENS)).text
    assert got == want
