"""Greedy generation through the torch engine (convert -> build -> ModelRunner + LLMEngine) equals
Hugging Face `generate(do_sample=False)` token for token, and its log-probs match HF's within 1e-4:
single and 16 concurrent requests, chunked context, block reuse, forced preemption, both attention paths."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.runtime.core.outputs import ScheduledRequest, SchedulerOutput
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import SchedulerConfig
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.engine_config import model_config_from_dict
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.attention import KernelAttention, LayerAttention, TorchAttention
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.rope import rotary_cos_sin
from pipeline.runtime.worker.attn_metadata import SequenceChunk, build_attention_metadata
from pipeline.runtime.worker.kv_cache import KVCache
from pipeline.runtime.worker.model_runner import ModelRunner
from pipeline.sources.tiny import make_tiny_checkpoint
from tests.serving_helpers import build_tiny_engine

LOGPROB_TOLERANCE = 1e-4
TINY_LIMITS = {"max_batch_size": 16, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 512}


@dataclass
class Case:
    prompts: list[list[int]]
    max_tokens: list[int]
    reference: list[list[int]]  # HF greedy outputs (prompt excluded)
    reference_logprobs: list[list[float]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine_dir(hf_dir: Path, out: Path, tokens_per_block: int = 8, **sections: Any) -> Path:
    """convert + build into `out/engine`, in the checkpoint's own dtype, with a KV capacity sized at run
    time (kv_max_tokens) rather than tiny_config's."""
    return build_tiny_engine(
        hf_dir,
        out,
        dtype="auto",
        engine=TINY_LIMITS,
        kv_cache={"tokens_per_block": tokens_per_block, "max_tokens": None},
        **sections,
    )


def hf_greedy(
    hf_dir: Path, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[list[list[int]], list[list[float]]]:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model_greedy(model, prompts, max_tokens)


def model_greedy(
    model: Any, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """HF `generate` greedy continuations of `prompts` and their tokens' log-probs, one prompt at a time."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt, count in zip(prompts, max_tokens, strict=True):
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=count,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            generated = out.sequences[0, len(prompt) :].tolist()
            tokens.append(generated)
            logprobs.append(
                [
                    torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, generated, strict=False)
                ]
            )
    return tokens, logprobs


def mixed_case(hf_dir: Path, vocab: int, seed: int, shared_prefix: int = 0) -> Case:
    """16 prompts of 2..400 tokens (optionally sharing a prefix) with 1..40 output tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    lengths = [2, 400, *(rng.randrange(2, 401 - shared_prefix) for _ in range(14))]
    prompts = [prefix + [rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randrange(1, 41) for _ in prompts]
    reference, reference_logprobs = hf_greedy(hf_dir, prompts, max_tokens)
    return Case(prompts, max_tokens, reference, reference_logprobs)


def run_engine(
    runner: ModelRunner, case: Case, end_id: int, logprobs: bool = True, **scheduler: object
) -> list[Request]:
    config = SchedulerConfig(**{**TINY_LIMITS, **scheduler})  # type: ignore[arg-type]
    engine = LLMEngine(runner, config)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, end_id=end_id, logprobs=logprobs)
        for n in case.max_tokens
    ]
    return engine.generate(case.prompts, params)


def assert_matches(requests: list[Request], case: Case) -> None:
    for i, request in enumerate(requests):
        assert request.output_token_ids == case.reference[i], (
            f"request {i} (prompt {len(case.prompts[i])} tokens)"
        )
        if not request.sampling_params.logprobs:
            continue
        worst = max(
            abs(a - b) for a, b in zip(request.output_logprobs, case.reference_logprobs[i], strict=True)
        )
        assert worst < LOGPROB_TOLERANCE, f"request {i}: logprob differs from HF by {worst}"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, int, int]:
    """(hf_dir, engine_dir, vocab_size, eos_id) of a tiny random model."""
    hf_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    engine_dir = make_engine_dir(hf_dir, tmp_path_factory.mktemp(f"engine-{request.param}"))
    config = AutoModelForCausalLM.from_pretrained(hf_dir).config
    return hf_dir, engine_dir, config.vocab_size, config.eos_token_id


@pytest.fixture(scope="module")
def mixed(model: tuple[Path, Path, int, int]) -> Case:
    hf_dir, _, vocab, _ = model
    return mixed_case(hf_dir, vocab, seed=1)


@pytest.fixture(scope="module")
def runner(model: tuple[Path, Path, int, int]) -> ModelRunner:
    return ModelRunner.from_engine_dir(model[1], RunnerArgs(device="cpu", kv_max_tokens=16384))


@pytest.mark.parametrize("logprobs", [True, False], ids=["logprobs", "greedy-head"])
def test_single_request(
    model: tuple[Path, Path, int, int], runner: ModelRunner, mixed: Case, logprobs: bool
) -> None:
    # Without log-probs, few-row greedy steps take the int8-screened lm_head (GreedyLMHead).
    assert runner.model.greedy_head is not None
    for i in (0, 1, 5):
        single = Case(
            [mixed.prompts[i]], [mixed.max_tokens[i]], [mixed.reference[i]], [mixed.reference_logprobs[i]]
        )
        assert_matches(run_engine(runner, single, model[3], logprobs=logprobs), single)


def test_greedy_head_is_an_exact_argmax() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 64, generator=generator)
    weight[1:200] = weight[0] + 1e-4 * torch.randn(199, 64, generator=generator)  # near-ties with row 0
    head = GreedyLMHead(weight)
    x = torch.randn(4, 64, generator=generator)
    x[0] = weight[0]  # a row whose logits nearly tie across 200 tokens
    for _ in range(20):
        assert head(x) == (x @ weight.T).argmax(dim=1).tolist()
        x = torch.randn(4, 64, generator=generator) * 3


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked-context"])
def test_16_concurrent(
    model: tuple[Path, Path, int, int], runner: ModelRunner, mixed: Case, chunked: bool
) -> None:
    budget = {"max_num_tokens": 96, "enable_chunked_context": True} if chunked else {}
    assert_matches(run_engine(runner, mixed, model[3], **budget), mixed)


def test_torch_attention_path(model: tuple[Path, Path, int, int], mixed: Case) -> None:
    runner = ModelRunner.from_engine_dir(
        model[1], RunnerArgs(device="cpu", kv_max_tokens=16384, attention="torch")
    )
    assert runner.attention_backend == "torch"
    assert_matches(
        run_engine(runner, mixed, model[3], max_num_tokens=128, enable_chunked_context=True), mixed
    )


def test_block_reuse(model: tuple[Path, Path, int, int], runner: ModelRunner) -> None:
    hf_dir, _, vocab, eos = model
    case = mixed_case(hf_dir, vocab, seed=2, shared_prefix=64)
    requests = run_engine(runner, case, eos, enable_block_reuse=True, max_batch_size=4)
    assert sum(r.stats.num_blocks_reused for r in requests) > 0, "no KV block was reused"
    assert_matches(requests, case)


def test_forced_preemption(model: tuple[Path, Path, int, int], mixed: Case) -> None:
    # 160 blocks of 8 tokens: far less than 16 concurrent sequences of up to ~440 tokens need.
    small = ModelRunner.from_engine_dir(model[1], RunnerArgs(device="cpu", kv_max_tokens=1280))
    requests = run_engine(small, mixed, model[3], policy="max_utilization", enable_chunked_context=True)
    assert sum(r.stats.num_preemptions for r in requests) > 0, "the KV cache was not small enough to preempt"
    assert_matches(requests, mixed)


@pytest.mark.slow
def test_smollm2_parity(smollm2_hf_dir: Path, tmp_path: Path) -> None:
    engine_dir = make_engine_dir(smollm2_hf_dir, tmp_path, tokens_per_block=32)
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", kv_max_tokens=32768))
    config = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir).config
    rng = random.Random(3)
    prompts = [
        [rng.randrange(100, config.vocab_size) for _ in range(rng.randrange(2, 401))] for _ in range(16)
    ]
    max_tokens = [rng.randrange(8, 33) for _ in prompts]
    case = Case(prompts, max_tokens, *hf_greedy(smollm2_hf_dir, prompts, max_tokens))
    for i in range(3):  # one at a time, through the int8-screened greedy lm_head (no log-probs)
        single = Case([prompts[i]], [max_tokens[i]], [case.reference[i]], [case.reference_logprobs[i]])
        assert_matches(run_engine(runner, single, config.eos_token_id, logprobs=False), single)
    assert_matches(run_engine(runner, case, config.eos_token_id, enable_chunked_context=True), case)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_attention_equals_torch_attention(window: int | None, cache_dtype: torch.dtype) -> None:
    """Mixed batch (a fresh prompt, a chunk after cached context, decodes) over shuffled blocks, GQA 6:2.
    A bf16 cache (a bf16 engine's, under fp32 compute): both paths round the new K/V the same way."""
    config = model_config_from_dict(
        {
            "architecture": "LlamaForCausalLM", "dtype": "float32", "vocab_size": 10, "hidden_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 8, "max_position_embeddings": 256, "norm_epsilon": 1e-6, "hidden_act": "silu",
            "sliding_window": window,
        }
    )  # fmt: skip
    if not kernels.kernels_available():
        pytest.skip(f"kernels unavailable: {kernels.kernels_unavailable_reason()}")
    block_size, num_blocks = 4, 64
    generator = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=generator).tolist()
    chunks = [
        SequenceChunk(0, 13, tables[0:4]),
        SequenceChunk(9, 7, tables[4:8]),
        SequenceChunk(30, 1, tables[8:16]),
    ]
    chunks.append(SequenceChunk(3, 1, tables[16:17]))
    layers = [LayerAttention(rotary_cos_sin(config, 256), window)]
    outputs = []
    for use_kernel in (True, False):
        cache = KVCache(config, num_blocks, block_size, cache_dtype, torch.device("cpu"), zero=True)
        cache.storage.copy_(torch.randn(cache.storage.shape, generator=torch.Generator().manual_seed(1)))
        meta = build_attention_metadata(chunks, block_size, torch.device("cpu"), padded=not use_kernel,
                                        windows=(window,))  # fmt: skip
        qkv = torch.randn(meta.num_tokens, 10 * 16, generator=torch.Generator().manual_seed(2))
        attention = (
            KernelAttention(cache, config, layers) if use_kernel else TorchAttention(cache, config, layers)
        )
        attention.begin_step(meta)
        outputs.append((attention(0, qkv, meta), cache.storage.clone()))
    (kernel_out, kernel_cache), (torch_out, torch_cache) = outputs
    assert torch.allclose(kernel_out, torch_out, atol=1e-5)
    assert torch.allclose(kernel_cache.float(), torch_cache.float(), atol=1e-6)  # the same K/V, same slots


def test_mistral_sliding_window(tmp_path_factory: pytest.TempPathFactory) -> None:
    hf_dir = tmp_path_factory.mktemp("tiny-mistral")
    make_tiny_checkpoint(hf_dir, arch="mistral", seed=0)
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "sliding_window": 24}))
    engine_dir = make_engine_dir(hf_dir, tmp_path_factory.mktemp("engine-mistral"))
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", kv_max_tokens=16384))
    rng = random.Random(4)
    prompts = [[rng.randrange(10, config["vocab_size"]) for _ in range(n)] for n in (3, 40, 90, 200)]
    case = Case(prompts, [30] * 4, *hf_greedy(hf_dir, prompts, [30] * 4))
    assert_matches(run_engine(runner, case, config["eos_token_id"]), case)
    # Blocks behind the window released as sequences grow, and handed to others: 48 blocks of 8 tokens
    # are fewer than the four sequences' 53 without the window.
    small = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", kv_max_tokens=384))
    requests = run_engine(
        small,
        case,
        config["eos_token_id"],
        attention_window=24,
        policy="max_utilization",
        enable_chunked_context=True,
    )
    assert sum(r.stats.num_blocks_released for r in requests) > 0
    assert_matches(requests, case)
    assert LLMEngine.from_engine_dir(engine_dir).scheduler.config.attention_window == 24  # served engines too


def test_runner_verifies_draft_tokens(model: tuple[Path, Path, int, int], runner: ModelRunner) -> None:
    """Drafts are checked against the target's greedy tokens: all-correct drafts yield a bonus token, a
    wrong draft is replaced by the target's token and ends the step's output."""
    hf_dir, _, vocab, _ = model
    rng = random.Random(5)
    prompt = [rng.randrange(10, vocab) for _ in range(37)]
    (ref,), _ = hf_greedy(hf_dir, [prompt], [8])
    request = Request("draft", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    request.block_table = list(range(-(-(len(prompt) + 8) // runner.tokens_per_block)))

    def step(num_new: int, drafts: list[int]) -> list[int]:
        request.draft_token_ids = drafts
        scheduled = ScheduledRequest(request, num_new, sample=True, num_draft_tokens=len(drafts))
        (sampled,) = runner.execute(SchedulerOutput([scheduled])).sampled_token_ids
        request.num_computed_tokens += num_new + len(drafts)
        request.token_ids += sampled
        return sampled

    assert step(len(prompt), []) == ref[:1]
    assert step(1, ref[1:4]) == ref[1:5]  # three accepted drafts + bonus
    wrong = (ref[6] + 1) % vocab
    assert step(1, [ref[5], wrong, ref[7]]) == ref[5:7]
