"""Speculative decoding without a model: prompt lookup, adaptive draft length, the draft-model proposer's
shadow/rollback bookkeeping, engine wiring and options. FakeRunner (tests/helpers.py) verifies drafts
through its fake paged KV cache, so a wrong rollback or block table changes the output."""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.runtime.core.outputs import RunnerOutput, SchedulerOutput
from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import SpeculationArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.engine_config import engine_config_from_dict
from pipeline.runtime.spec_decode import adaptive
from pipeline.runtime.spec_decode.adaptive import AdaptiveDraftLength
from pipeline.runtime.spec_decode.draft_model import DraftModelProposer
from pipeline.runtime.spec_decode.factory import make_proposer
from pipeline.runtime.spec_decode.metrics import spec_decode_stats
from pipeline.runtime.spec_decode.proposer import NgramProposer, Proposer
from tests import helpers
from tests.helpers import FakeRunner, check_blocks, make_config, make_prompt, reference_output

PERIOD = 5


def copying_next_token(token_ids: list[int]) -> int:
    """A fake model whose output repeats its last PERIOD tokens (prompt lookup's best case), with a
    pseudo-random break every 16 positions (where drafts fail)."""
    if len(token_ids) < PERIOD or len(token_ids) % 16 == 0:
        return zlib.crc32(array("i", token_ids).tobytes()) % helpers.VOCAB_SIZE
    return token_ids[-PERIOD]


@pytest.fixture
def copying_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # FakeRunner and reference_output both call helpers.fake_next_token.
    monkeypatch.setattr(helpers, "fake_next_token", copying_next_token)


def decoding_request(token_ids: list[int], num_prompt: int, max_tokens: int = 100) -> Request:
    request = Request("r", token_ids[:num_prompt], SamplingParams(max_tokens=max_tokens))
    request.token_ids = list(token_ids)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = len(token_ids) - 1
    return request


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], extra: Callable[[], None]
) -> list[Request]:
    """engine.generate, checking block accounting (and `extra`) after every step."""
    requests = [
        engine.add_request(f"req-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for _ in range(10_000):
        if all(r.status.finished for r in requests):
            return requests
        engine.step()
        check_blocks(engine.scheduler)
        extra()
    raise AssertionError("engine did not finish")


def make_workload(num: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [make_prompt(i, rng.randrange(1, 40)) for i in range(num)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 60)) for _ in prompts]
    return prompts, params


# --- prompt lookup ---


def brute_force_lookup(token_ids: list[int], min_match: int, max_match: int, num_drafts: int) -> list[int]:
    num_tokens = len(token_ids)
    for n in range(min(max_match, num_tokens - 1), min_match - 1, -1):
        suffix = token_ids[num_tokens - n :]
        for start in range(num_tokens - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                extended = list(token_ids)
                while len(extended) < start + n + num_drafts:
                    extended.append(extended[len(extended) - num_tokens + start + n])
                return extended[start + n : start + n + num_drafts]
    return []


def test_ngram_prefers_the_longest_then_most_recent_match() -> None:
    proposer = NgramProposer(max_draft_len=3, min_match=1, max_match=3)
    # "7 8 9" occurs earlier once (followed by 1 2 3); "8 9" more recently (followed by 5 6).
    tokens = [7, 8, 9, 1, 2, 3, 0, 8, 9, 5, 6, 4, 7, 8, 9]
    assert proposer.lookup(decoding_request(tokens, 4), 3) == [1, 2, 3]
    tokens = [8, 9, 5, 6, 4, 8, 9, 1, 2, 0, 9]  # only "9" matches: its most recent occurrence is at 6
    assert proposer.lookup(decoding_request(tokens, 4), 3) == [1, 2, 0]


def test_ngram_copy_overlaps_into_the_draft_and_misses_give_nothing() -> None:
    proposer = NgramProposer(max_draft_len=6, min_match=2, max_match=2)
    # "4 5" was last followed by "4 5 ...": the draft continues the period-2 pattern past the end.
    assert proposer.lookup(decoding_request([1, 4, 5, 4, 5], 2), 6) == [4, 5, 4, 5, 4, 5]
    assert proposer.lookup(decoding_request([1, 2, 3, 4], 2), 4) == []


def test_ngram_index_matches_brute_force_as_tokens_grow() -> None:
    rng = random.Random(0)
    for trial in range(30):
        min_match, max_match = rng.choice([(1, 1), (1, 3), (2, 4)])
        proposer = NgramProposer(4, min_match, max_match)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        request = decoding_request(tokens, len(tokens))
        for _ in range(40):
            num_drafts = rng.randrange(1, 6)
            expected = brute_force_lookup(request.token_ids, min_match, max_match, num_drafts)
            assert proposer.lookup(request, num_drafts) == expected, (trial, request.token_ids)
            request.token_ids += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_ngram_proposes_only_for_decoding_requests_within_max_tokens() -> None:
    proposer = NgramProposer(max_draft_len=4, adaptive=False)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    decoding = decoding_request(tokens, 3, max_tokens=100)
    near_end = decoding_request(tokens, 3, max_tokens=7)  # 5 outputs: one sampled + 1 draft left
    mid_prompt = decoding_request(tokens, 3)
    mid_prompt.num_computed_tokens = 2
    opted_out = decoding_request(tokens, 3)
    opted_out.sampling_params = SamplingParams(max_tokens=100, allow_speculation=False)
    for i, request in enumerate((decoding, near_end, mid_prompt, opted_out)):
        request.request_id = f"r{i}"
    proposer.propose([decoding, near_end, mid_prompt, opted_out])
    assert decoding.draft_token_ids == [3, 1, 2, 3]
    assert near_end.draft_token_ids == [3]
    assert mid_prompt.draft_token_ids == [] and opted_out.draft_token_ids == []


def test_ngram_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="min_match=3 max_match=2"):
        NgramProposer(4, min_match=3, max_match=2)


# --- adaptive draft length ---


def feed(lengths: AdaptiveDraftLength, request: Request, num_drafted: int, num_accepted: int) -> int:
    request.stats.num_draft_tokens += num_drafted
    request.stats.num_accepted_draft_tokens += num_accepted
    return lengths.next_len(request)


def test_adaptive_length_grows_on_acceptance_and_shrinks_on_rejection() -> None:
    lengths = AdaptiveDraftLength(8)
    request = decoding_request([1, 2], 1)
    assert lengths.next_len(request) == 8
    assert feed(lengths, request, 8, 3) == 3  # shrinks to what was accepted
    assert feed(lengths, request, 3, 3) == 6  # all accepted: doubles
    assert feed(lengths, request, 6, 6) == 8  # capped
    assert feed(lengths, request, 0, 0) == 8  # a step without drafts teaches nothing


def test_adaptive_length_backs_off_exponentially_while_nothing_is_accepted() -> None:
    lengths = AdaptiveDraftLength(4)
    request = decoding_request([1, 2], 1)
    lengths.next_len(request)
    pauses = []
    for _ in range(8):
        assert feed(lengths, request, 1, 0) == 0  # rejected: pause
        num_paused = 1
        while lengths.next_len(request) == 0:
            num_paused += 1
        pauses.append(num_paused)
    assert pauses == [1, 2, 4, 8, 16, 32, 32, 32][: len(pauses)]
    assert max(pauses) == adaptive.MAX_BACKOFF_STEPS
    assert feed(lengths, request, 1, 1) == 2  # an acceptance resets the pause and grows again
    assert feed(lengths, request, 2, 0) == 0 and lengths.next_len(request) == 1


def test_adaptive_length_off_and_forgetting() -> None:
    request = decoding_request([1, 2], 1)
    fixed = AdaptiveDraftLength(5, enabled=False)
    assert [feed(fixed, request, 5, 0) for _ in range(3)] == [5, 5, 5]
    lengths = AdaptiveDraftLength(4)
    lengths.next_len(request)
    feed(lengths, request, 4, 1)
    lengths.retain([])
    assert lengths.next_len(request) == 4  # a fresh start


# --- engine with prompt lookup ---


@pytest.mark.parametrize("adaptive_len", [True, False], ids=["adaptive", "fixed"])
def test_prompt_lookup_outputs_equal_plain_decoding(copying_model: None, adaptive_len: bool) -> None:
    prompts, params = make_workload(12, seed=1)
    engine = LLMEngine(
        FakeRunner(64, 4), make_config(max_batch_size=6), NgramProposer(4, adaptive=adaptive_len)
    )
    requests = run_engine(engine, prompts, params, lambda: None)
    plain = LLMEngine(FakeRunner(64, 4), make_config(max_batch_size=6))
    plain.generate(prompts, params)
    for request, prompt, p in zip(requests, prompts, params, strict=True):
        assert request.output_token_ids == reference_output(prompt, p)
    stats = engine.stats()
    assert stats.num_accepted_draft_tokens > stats.num_draft_tokens / 2 > 0
    assert stats.num_steps < 0.6 * plain.stats().num_steps
    assert stats.num_kv_blocks_used == 0


def test_prompt_lookup_with_preemption_and_block_reuse(copying_model: None) -> None:
    prompts, params = make_workload(16, seed=2)
    prefix = make_prompt(99, 12)
    prompts = [prefix + p for p in prompts]
    engine = LLMEngine(
        FakeRunner(32, 4),
        make_config(policy="max_utilization", enable_block_reuse=True, enable_chunked_context=True),
        NgramProposer(6),
    )
    requests = run_engine(engine, prompts, params, lambda: None)
    for request, prompt, p in zip(requests, prompts, params, strict=True):
        assert request.output_token_ids == reference_output(prompt, p)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_accepted_draft_tokens > 0
    assert stats.num_kv_blocks_used == 0


# --- draft-model proposer ---


class NoisyDraftRunner(FakeRunner):
    """A draft 'model' that agrees with the target except at positions where a hash says otherwise."""

    def __init__(self, num_kv_blocks: int, tokens_per_block: int, error_rate: float) -> None:
        super().__init__(num_kv_blocks, tokens_per_block)
        self.error_rate = error_rate

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        output = super().execute(scheduler_output)
        for sched, sampled in zip(scheduler_output.scheduled, output.sampled_token_ids, strict=True):
            position = sched.request.num_computed_tokens + sched.num_new_tokens
            if sampled and zlib.crc32(str(position).encode()) % 1000 < 1000 * self.error_rate:
                sampled[0] = (sampled[0] + 1) % helpers.VOCAB_SIZE
        return output


def draft_engine(draft: FakeRunner, **config: Any) -> tuple[LLMEngine, DraftModelProposer]:
    proposer = DraftModelProposer(draft, max_draft_len=4)
    return LLMEngine(FakeRunner(64, 4), make_config(**config), proposer), proposer


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0], ids=["self-draft", "noisy", "always-wrong"])
def test_draft_model_outputs_equal_plain_decoding(error_rate: float) -> None:
    prompts, params = make_workload(12, seed=3)
    engine, proposer = draft_engine(NoisyDraftRunner(96, 2, error_rate), max_batch_size=5)

    def draft_cache_holds_only_live_shadows() -> None:
        bm = proposer.block_manager
        assert sum(bm.ref_counts) == sum(len(s.draft.block_table) for s in proposer._shadows.values())

    requests = run_engine(engine, prompts, params, draft_cache_holds_only_live_shadows)
    for request, prompt, p in zip(requests, prompts, params, strict=True):
        assert request.output_token_ids == reference_output(prompt, p)
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    if error_rate == 0.0:
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
    elif error_rate == 1.0:
        assert stats.num_accepted_draft_tokens == 0
    else:
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    engine.step()  # idle: the proposer drops the last finished requests' shadows
    assert proposer.num_tracked_requests == 0 and proposer.block_manager.num_used_blocks == 0
    assert stats.num_kv_blocks_used == 0


def test_draft_model_with_a_tiny_draft_cache_drafts_less_but_stays_exact() -> None:
    prompts, params = make_workload(6, seed=4)
    engine, proposer = draft_engine(NoisyDraftRunner(12, 2, 0.2), max_batch_size=6)
    requests = run_engine(engine, prompts, params, lambda: None)
    for request, prompt, p in zip(requests, prompts, params, strict=True):
        assert request.output_token_ids == reference_output(prompt, p)
    assert engine.stats().num_draft_tokens > 0


class FailingDraftRunner(NoisyDraftRunner):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self.num_calls % 3 == 2:
            self.num_calls += 1
            raise RuntimeError("draft model out of memory")
        return super().execute(scheduler_output)


def test_a_failing_draft_model_costs_drafts_not_requests(caplog: pytest.LogCaptureFixture) -> None:
    prompts, params = make_workload(6, seed=5)
    engine, proposer = draft_engine(FailingDraftRunner(96, 2, 0.0), max_batch_size=6)
    requests = run_engine(engine, prompts, params, lambda: None)
    for request, prompt, p in zip(requests, prompts, params, strict=True):
        assert request.output_token_ids == reference_output(prompt, p)
    assert "draft model failed" in caplog.text
    assert engine.stats().num_accepted_draft_tokens > 0


def test_draft_model_shadow_is_rolled_back_to_the_accepted_tokens() -> None:
    draft = NoisyDraftRunner(32, 2, 0.0)
    proposer = DraftModelProposer(draft, max_draft_len=3, adaptive=False)
    target = decoding_request(make_prompt(1, 7), 6)
    reference = reference_output(target.prompt_token_ids, SamplingParams(max_tokens=12))
    target.token_ids = target.prompt_token_ids + reference[:1]
    target.num_computed_tokens = 6
    proposer.propose([target])
    assert target.draft_token_ids == reference[1:4]
    (shadow,) = proposer._shadows.values()
    assert shadow.draft.num_computed_tokens == 7 + 2  # prompt + first output + two drafts fed back
    # The target accepted one draft, then sampled something else: the shadow keeps 7 + 1 tokens' K/V.
    target.token_ids += [reference[1], 63 - reference[2]]
    target.num_computed_tokens = 8
    proposer._sync(target)
    assert shadow.draft.num_computed_tokens == 8
    assert shadow.draft.token_ids == target.token_ids
    assert len(shadow.draft.block_table) == proposer.block_manager.num_blocks_for(8)


# --- options and metrics ---


def engine_config(speculative_mode: str | None, max_draft_len: int = 0, **spec: Any) -> Any:
    build = {
        "max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 64,
        "max_draft_len": max_draft_len, "speculative_decoding_mode": speculative_mode,
        "speculative_config": spec,
    }  # fmt: skip
    pretrained = {
        "architecture": "LlamaForCausalLM", "dtype": "float32", "vocab_size": 64, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 8, "max_position_embeddings": 256, "norm_epsilon": 1e-6, "hidden_act": "silu",
    }  # fmt: skip
    return engine_config_from_dict({"version": "0", "pretrained_config": pretrained, "build_config": build})


def test_make_proposer_follows_the_build_and_its_overrides() -> None:
    assert make_proposer(engine_config(None), None) is None
    ngram = make_proposer(
        engine_config("ngram", 3, ngram_min_match=2, ngram_max_match=5, adaptive=False), None
    )
    assert isinstance(ngram, NgramProposer)
    assert (ngram.min_match, ngram.max_match, ngram.draft_len.max_draft_len) == (2, 5, 3)
    assert not ngram.draft_len.enabled
    assert make_proposer(engine_config("ngram", 3), None, SpeculationArgs(mode="none")) is None
    forced: Proposer | None = make_proposer(
        engine_config(None), None, SpeculationArgs(mode="ngram", max_draft_len=2)
    )
    assert isinstance(forced, NgramProposer) and forced.draft_len.max_draft_len == 2


@pytest.mark.parametrize(
    ("mode", "options", "error", "match"),
    [
        ("ngram", {"max_draft_len": 0}, ConfigError, "max_draft_len=0"),
        ("ngram", {"ngram_min_match": 4}, ConfigError, "min_match=4 max_match=3"),
        ("draft_tokens_external", {}, ConfigError, "needs the draft engine directory"),
        ("medusa", {}, UnsupportedModelError, "'medusa' is not implemented"),
    ],
)
def test_make_proposer_errors(mode: str, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_proposer(engine_config(mode, 4), None, SpeculationArgs(**options))


def test_engine_config_rejects_bad_ngram_sizes() -> None:
    with pytest.raises(ConfigError, match="speculative_config.ngram_min_match=0"):
        from pipeline.runtime.engine_config import validate_engine_config

        validate_engine_config(engine_config("ngram", 3, ngram_min_match=0))


def test_spec_decode_stats_per_request() -> None:
    request = decoding_request([1, 2, 3], 2)
    assert spec_decode_stats(request.stats, request.num_output_tokens).acceptance_rate is None
    request.token_ids += [4] * 20  # 21 outputs: 1 from the prefill, 20 from decode steps
    request.stats.num_draft_tokens, request.stats.num_accepted_draft_tokens = 24, 12
    stats = spec_decode_stats(request.stats, request.num_output_tokens)
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.num_decode_steps == 8
    assert stats.accepted_tokens_per_step == pytest.approx(12 / 8)
