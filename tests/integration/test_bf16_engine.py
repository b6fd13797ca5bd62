"""A bfloat16 engine on CPU: its decoder layers keep bf16 weights (half the fp32 bytes) and multiply
bf16-rounded activations, while the embedding, norms, attention and head stay fp32. Its greedy choices are
HF float32's (on the same bf16-rounded weights) up to that rounding, on the prefill and the decode path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import SchedulerConfig
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.layers import DenseLinear
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.kernel_helpers import assert_widened_logits
from tests.serving_helpers import build_tiny_engine

LIMITS = {"max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 512}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bf16_runner(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    engine_dir = build_tiny_engine(
        tiny_llama_dir,
        tmp_path_factory.mktemp("bf16-engine"),
        dtype="bfloat16",
        engine=LIMITS,
        kv_cache={"tokens_per_block": 8, "max_tokens": None},
    )
    return ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu"))


def rounded_hf_model(hf_dir: Path) -> torch.nn.Module:
    """HF float32 with every parameter rounded to bf16, as the bf16 checkpoint stores them."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def test_layer_weights_are_bf16_and_the_rest_computes_in_fp32(bf16_runner: ModelRunner) -> None:
    weights = bf16_runner.model.weights
    for layer in weights.layers:
        for linear in (layer.qkv, layer.dense, layer.gate_up, layer.proj):
            assert linear.weight.dtype == torch.bfloat16  # type: ignore[attr-defined]
        assert layer.input_norm.dtype == torch.float32
    assert bf16_runner.dtype == torch.float32  # activations, KV cache
    assert weights.embedding.dtype == torch.float32  # untied here
    # The lm_head stays as stored: fp32 arithmetic on its widened values where the kernels run.
    head = weights.lm_head
    assert isinstance(head, DenseLinear)
    assert head.widened == kernels.kernels_available()
    assert head.weight.dtype == (torch.bfloat16 if head.widened else torch.float32)
    model, x = bf16_runner.model, torch.randn(3, head.weight.shape[1])
    normed = model.norm(x.clone(), None, weights.final_norm)
    fp32_copy = DenseLinear(head.weight.float())(normed)
    assert_widened_logits(lambda: model.compute_logits(x.clone()), fp32_copy)
    if kernels.kernels_available():
        assert bf16_runner.model.fused is not None  # decode steps take the kernel's bf16 path


def test_greedy_choices_match_float32_up_to_bf16_rounding(
    bf16_runner: ModelRunner, tiny_llama_dir: Path
) -> None:
    rng = random.Random(0)
    vocab = bf16_runner.config.model.vocab_size
    # 300 tokens: prefill rows beyond the kernel's limit (oneDNN / widened bf16 GEMMs); then decode steps
    # of 1-4 rows through the fused kernel.
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (3, 40, 300, 17)]
    engine = LLMEngine(bf16_runner, SchedulerConfig(**LIMITS))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=True)
    requests = engine.generate(prompts, [params] * len(prompts))

    # The yardstick: HF's own bf16 model (bf16 everywhere) on the same positions.
    model = rounded_hf_model(tiny_llama_dir)
    model_bf16 = rounded_hf_model(tiny_llama_dir).to(torch.bfloat16)
    engine_error, hf_bf16_error, choice_gap = [], [], []
    with torch.inference_mode():
        for prompt, request in zip(prompts, requests, strict=True):
            ids = torch.tensor([prompt + request.output_token_ids])
            rows = slice(len(prompt) - 1, len(prompt) - 1 + len(request.output_token_ids))
            exact = torch.log_softmax(model(ids).logits[0, rows].float(), -1)
            half = torch.log_softmax(model_bf16(ids).logits[0, rows].float(), -1)
            tokens = torch.tensor(request.output_token_ids)
            chosen = exact.gather(1, tokens[:, None])[:, 0]
            engine_error += (chosen - torch.tensor(request.output_logprobs)).abs().tolist()
            hf_bf16_error += (chosen - half.gather(1, tokens[:, None])[:, 0]).abs().tolist()
            choice_gap += (exact.max(1).values - chosen).tolist()  # 0 where the engine picked HF's argmax
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # Measured: engine mean 0.012 / worst 0.06, HF bf16 mean 0.03 / worst 0.13 (logits up to ~8).
    assert mean(engine_error) <= mean(hf_bf16_error) and max(engine_error) <= max(hf_bf16_error)
    assert max(choice_gap) <= max(hf_bf16_error)  # a different pick is a near-tie, never a real miss
    assert mean(engine_error) > 1e-5  # the activations really are rounded: float32 compute agrees to ~1e-6


def test_a_tied_bf16_head_read_widened_gives_the_fp32_copys_tokens_and_logprobs(
    tiny_qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied bf16 lm_head (the embedding too) kept as stored gives the same tokens and log-probs, bit for bit,
    as the fp32 copy it widens to: greedy steps through the screening head, log-probs through the full logits."""
    engine_dir = build_tiny_engine(
        tiny_qwen2_dir,
        tmp_path,
        dtype="bfloat16",
        engine=LIMITS,
        kv_cache={"tokens_per_block": 8, "max_tokens": None},
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 200) for _ in range(n)] for n in (5, 23, 2)]

    def run(tiles: bool = False) -> tuple[ModelRunner, list[tuple[list[int], list[float]]]]:
        # The register tiles: AMX tiles sum a widened head's logits in another order (checked below).
        before = kernels.set_tiles(tiles) if kernels.kernels_available() else False
        try:
            runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu"))
            engine = LLMEngine(runner, SchedulerConfig(**LIMITS))  # type: ignore[arg-type]
            greedy = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
            logprobs = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0, logprobs=True)
            out = engine.generate(prompts * 2, [greedy] * len(prompts) + [logprobs] * len(prompts))
            return runner, [(r.output_token_ids, r.output_logprobs) for r in out]
        finally:
            if kernels.kernels_available():
                kernels.set_tiles(before)

    if kernels.kernels_available() and kernels.tiles_available():
        _, on_tiles = run(tiles=True)
    widened_runner, widened = run()
    weights = widened_runner.model.weights
    assert weights.embedding is weights.lm_head.weight  # type: ignore[attr-defined]
    assert weights.embedding.dtype == (torch.bfloat16 if kernels.kernels_available() else torch.float32)

    from pipeline.runtime.worker import model_runner

    load = model_runner.load_model_weights
    monkeypatch.setattr(
        model_runner,
        "load_model_weights",
        lambda *args, **kwargs: load(*args, **{**kwargs, "widened_head": False}),
    )
    fp32_runner, fp32_copy = run()
    assert fp32_runner.model.weights.embedding.dtype == torch.float32
    assert widened == fp32_copy
    if kernels.kernels_available() and kernels.tiles_available():
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(on_tiles, fp32_copy, strict=True):
            assert tokens == want_tokens
            assert logprobs == pytest.approx(want_logprobs, rel=1e-5, abs=1e-6)
