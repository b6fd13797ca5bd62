"""Speculative decoding through the real engine (convert -> build -> ModelRunner + LLMEngine + proposer):
outputs equal those without speculation token for token (greedy and seeded sampling; single and 16
concurrent requests; chunked context and preemption), unseeded sampled outputs keep the target's
distribution (chi-square), no KV block leaks on either model, and the build config reaches the engine."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pipeline.errors import MissingArtifactError
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import SchedulerConfig
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs, SpeculationArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.spec_decode.draft_model import DraftModelProposer
from pipeline.runtime.spec_decode.proposer import NgramProposer, Proposer
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.integration.test_parity import TINY_LIMITS, make_engine_dir

LOGPROB_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def perturbed_copy(hf_dir: Path, out: Path, noise: float) -> Path:
    """The checkpoint with relative Gaussian noise on every weight: a draft model that agrees with the
    target often, but not always."""
    shutil.copytree(hf_dir, out)
    generator = torch.Generator().manual_seed(7)
    tensors = load_file(out / "model.safetensors")
    for name, tensor in tensors.items():
        tensors[name] = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def draft_proposer(engine_dir: Path, max_draft_len: int = 4, seed: int | None = None) -> DraftModelProposer:
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", kv_max_tokens=16384, seed=seed))
    return DraftModelProposer(runner, max_draft_len, max_positions=runner.max_positions)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    noisy = perturbed_copy(tiny_llama_dir, root / "noisy-hf", noise=0.05)
    return {
        "target": make_engine_dir(tiny_llama_dir, root / "target"),
        "noisy": make_engine_dir(noisy, root / "noisy"),
    }


@pytest.fixture(scope="module")
def runner(engines: dict[str, Path]) -> ModelRunner:
    return ModelRunner.from_engine_dir(engines["target"], RunnerArgs(device="cpu", kv_max_tokens=16384))


PROPOSERS: dict[str, Callable[[dict[str, Path]], Proposer]] = {
    "ngram": lambda engines: NgramProposer(4),
    "ngram-fixed-len": lambda engines: NgramProposer(5, min_match=1, max_match=2, adaptive=False),
    "self-draft": lambda engines: draft_proposer(engines["target"], seed=99),
    "noisy-draft": lambda engines: draft_proposer(engines["noisy"], max_draft_len=3),
}


def mixed_workload(seed: int, vocab: int = 2000) -> tuple[list[list[int]], list[int]]:
    """16 prompts of 2..400 tokens (one with a repeated stretch, for prompt lookup) and 1..64 outputs."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(n)]
        for n in [2, 400, *(rng.randrange(2, 401) for _ in range(14))]
    ]
    prompts[2] = prompts[2][:60] * 3
    return prompts, [rng.randrange(1, 65) for _ in prompts]


def generate(
    runner: ModelRunner,
    proposer: Proposer | None,
    prompts: list[list[int]],
    params: list[SamplingParams],
    **config: Any,
) -> tuple[list[Request], LLMEngine]:
    engine = LLMEngine(runner, SchedulerConfig(**{**TINY_LIMITS, **config}), proposer)
    requests = engine.generate(prompts, params)
    engine.step()  # idle step: a draft-model proposer releases the finished requests' shadows
    assert engine.stats().num_kv_blocks_used == 0, "target KV blocks leaked"
    if isinstance(proposer, DraftModelProposer):
        assert proposer.block_manager.num_used_blocks == 0, "draft KV blocks leaked"
    return requests, engine


def assert_same_outputs(got: list[Request], expected: list[Request]) -> None:
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.output_token_ids == b.output_token_ids, f"request {i} (prompt {a.num_prompt_tokens} tokens)"
        if a.output_logprobs:
            worst = max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True))
            assert worst < LOGPROB_TOLERANCE, f"request {i}: logprob differs by {worst}"


@pytest.fixture(scope="module")
def greedy_case(runner: ModelRunner) -> tuple[list[list[int]], list[SamplingParams], list[Request]]:
    prompts, max_tokens = mixed_workload(seed=1)
    params = [SamplingParams(max_tokens=n, temperature=0.0, end_id=2) for n in max_tokens]
    baseline, _ = generate(runner, None, prompts, params)
    return prompts, params, baseline


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_16_concurrent_equal_without_speculation(
    name: str, engines: dict[str, Path], runner: ModelRunner, greedy_case: Any
) -> None:
    prompts, params, baseline = greedy_case
    requests, engine = generate(runner, PROPOSERS[name](engines), prompts, params)
    assert_same_outputs(requests, baseline)
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    if name == "self-draft":
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
    if name == "noisy-draft":
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("name", ["ngram", "noisy-draft"])
def test_greedy_single_requests_with_logprobs(
    name: str, engines: dict[str, Path], runner: ModelRunner, greedy_case: Any
) -> None:
    prompts, params, _ = greedy_case
    for i in (0, 2, 5):
        single = [SamplingParams(max_tokens=params[i].max_tokens, temperature=0.0, end_id=2, logprobs=True)]
        (plain,), _ = generate(runner, None, [prompts[i]], single)
        (spec,), _ = generate(runner, PROPOSERS[name](engines), [prompts[i]], single)
        assert_same_outputs([spec], [plain])


def test_chunked_context_and_preemption(engines: dict[str, Path], greedy_case: Any) -> None:
    prompts, params, baseline = greedy_case
    # 160 blocks of 8 tokens: far less than 16 sequences of up to ~460 tokens need.
    small = ModelRunner.from_engine_dir(engines["target"], RunnerArgs(device="cpu", kv_max_tokens=1280))
    for proposer in (NgramProposer(4), draft_proposer(engines["noisy"])):
        requests, engine = generate(
            small,
            proposer,
            prompts,
            params,
            policy="max_utilization",
            enable_chunked_context=True,
            max_num_tokens=128,
        )
        assert engine.stats().num_preemptions > 0, "the KV cache was not small enough to preempt"
        assert_same_outputs(requests, baseline)


@pytest.mark.parametrize("name", ["ngram", "noisy-draft"])
def test_seeded_sampling_equals_sampling_without_speculation(
    name: str, engines: dict[str, Path], runner: ModelRunner, greedy_case: Any
) -> None:
    prompts, _, _ = greedy_case
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=i)
        for i in range(len(prompts))
    ]
    baseline, _ = generate(runner, None, prompts, params)
    requests, engine = generate(runner, PROPOSERS[name](engines), prompts, params)
    assert_same_outputs(requests, baseline)
    assert engine.stats().num_draft_tokens > 0


# --- the target's distribution, unseeded ---

TOP_K = 3
NUM_OUTPUTS = 3


def expected_joint(hf_dir: Path, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under top-k=3 sampling at temperature 1, from Hugging Face's model."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def top_k(prefix: tuple[int, ...]) -> list[tuple[int, float]]:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        values, ids = torch.topk(logits, TOP_K)
        return list(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_OUTPUTS):
        joint = {seq + (t,): p * q for seq, p in joint.items() for t, q in top_k(seq)}
    return joint


@pytest.mark.parametrize("name", ["ngram", "self-draft"])
def test_unseeded_sampling_keeps_the_target_distribution(
    name: str, tiny_llama_dir: Path, engines: dict[str, Path]
) -> None:
    # Six random tokens grown four times by their own top-3 next tokens (picked by a search over seeds): the
    # sampled tokens then occur in the prompt, so prompt lookup drafts, and about half of its drafts pass.
    prompt = [1133, 1885, 38, 201, 1483, 1730, 1710, 1798, 226, 497, 289, 968, 483, 1596, 1681, 64, 21, 1303]
    expected = expected_joint(tiny_llama_dir, prompt)
    runner = ModelRunner.from_engine_dir(
        engines["target"], RunnerArgs(device="cpu", kv_max_tokens=16384, seed=1234)
    )
    proposer = PROPOSERS[name](engines)
    engine = LLMEngine(runner, SchedulerConfig(**TINY_LIMITS), proposer)
    num_samples = 1600
    params = SamplingParams(max_tokens=NUM_OUTPUTS, temperature=1.0, top_k=TOP_K)
    requests = engine.generate([prompt] * num_samples, params)
    counts = Counter(tuple(r.output_token_ids) for r in requests)
    assert set(counts) <= set(expected)
    statistic = sum((counts[seq] - num_samples * p) ** 2 / (num_samples * p) for seq, p in expected.items())
    dof = len(expected) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
    assert p_value > 1e-3, f"chi-square {statistic:.1f} over {dof} dof: p = {p_value:.2g}"
    stats = engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens


# --- config -> engine ---


def test_build_config_reaches_the_engine(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # draft_config and its work dir resolve against the working directory
    ngram = {
        "mode": "ngram",
        "max_draft_len": 3,
        "ngram": {"min_match": 2, "max_match": 4},
        "adaptive": False,
    }
    engine = LLMEngine.from_engine_dir(
        make_engine_dir(tiny_llama_dir, tmp_path / "ngram", speculative=ngram),
        EngineArgs(runner=RunnerArgs(device="cpu", kv_max_tokens=4096)),
    )
    proposer = engine.proposer
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_match, proposer.max_match, proposer.draft_len.max_draft_len) == (2, 4, 3)
    assert not proposer.draft_len.enabled

    draft_yaml = tmp_path / "draft.yaml"
    draft_yaml.write_text(
        yaml.safe_dump({"name": "draft", "source": {"kind": "local", "path": str(tiny_llama_dir)}})
    )
    spec = {"mode": "draft_model", "draft_config": "draft.yaml", "max_draft_len": 2}
    with pytest.raises(MissingArtifactError, match="draft.yaml has no engine at"):
        make_engine_dir(tiny_llama_dir, tmp_path / "target", speculative=spec)
    make_engine_dir(tiny_llama_dir, tmp_path / "build" / "draft")  # where draft.yaml's engine lands
    target_dir = make_engine_dir(tiny_llama_dir, tmp_path / "target", speculative=spec)
    engine = LLMEngine.from_engine_dir(
        target_dir, EngineArgs(runner=RunnerArgs(device="cpu", kv_max_tokens=4096))
    )
    assert isinstance(engine.proposer, DraftModelProposer)
    assert engine.proposer.draft_len.max_draft_len == 2
    plain = LLMEngine.from_engine_dir(
        target_dir,
        EngineArgs(
            runner=RunnerArgs(device="cpu", kv_max_tokens=4096), speculation=SpeculationArgs(mode="none")
        ),
    )
    assert plain.proposer is None
    prompts = [[5, 6, 7, 8] * 5, [100, 200]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outputs = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert outputs == [r.output_token_ids for r in plain.generate(prompts, params)]
    assert engine.stats().num_accepted_draft_tokens == engine.stats().num_draft_tokens > 0


# --- SmolLM2 ---


@pytest.mark.slow
def test_smollm2_greedy_equal_without_speculation(smollm2_hf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    engine_dir = make_engine_dir(smollm2_hf_dir, tmp_path / "smollm2", tokens_per_block=32)
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", kv_max_tokens=32768))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    texts = [
        f"Repeat this code exactly, then stop:\n{code}",
        "Write a short poem about the sea.",
        "List the days of the week, one per line.",
        f"Rename `add` to `plus` in this code:\n{code}",
    ] * 4
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]
    params = [SamplingParams(max_tokens=40, temperature=0.0, end_id=tokenizer.eos_token_id) for _ in prompts]
    baseline, _ = generate(runner, None, prompts, params)
    requests, engine = generate(runner, NgramProposer(4), prompts, params)
    assert_same_outputs(requests, baseline)
    assert engine.stats().num_accepted_draft_tokens > 0
    for i in (0, 1):  # one at a time: prompt lookup, and SmolLM2 as its own draft model
        for proposer in (NgramProposer(4), draft_proposer(engine_dir)):
            (single,), _ = generate(runner, proposer, [prompts[i]], [params[i]])
            assert single.output_token_ids == baseline[i].output_token_ids
