"""Sampler: HF-equivalent logits processing, seeded determinism independent of batch composition and
speculation, nucleus/top-k support, log-prob convention."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TopPLogitsWarper,
)

from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.worker.sampler import (
    Sampler,
    SampleRow,
    accept_drafts,
    completing_tokens,
    process_logits,
    sample_from,
)

VOCAB = 50


def make_row(
    prompt: list[int],
    output: list[int],
    num_drafts_before: int = 0,
    drafts: list[int] | None = None,
    **params: object,
) -> SampleRow:
    request = Request("r", list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    request.token_ids += output
    request.draft_token_ids = list(drafts or [])
    return SampleRow(request, num_drafts_before)


def random_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = random_logits(4)
    rows = [make_row([1, 2], [], temperature=0.0, logprobs=True) for _ in range(4)]
    tokens, logprobs = Sampler()(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_no_logprobs_unless_asked() -> None:
    assert Sampler()(random_logits(2), [make_row([1], [], temperature=0.0)] * 2)[1] is None


def test_logit_bias_is_added_before_greedy_and_log_probs() -> None:
    logits = random_logits(2)
    loser = int(logits[0].argmin())
    biased = make_row([1], [], temperature=0.0, logprobs=True, logit_bias=((loser, 1000.0),))
    plain = make_row([1], [], temperature=0.0)
    tokens, logprobs = Sampler()(logits, [biased, plain])
    assert tokens == [loser, int(logits[1].argmax())]
    shifted = logits[0].clone()
    shifted[loser] += 1000.0
    assert torch.equal(process_logits(logits[0], biased), shifted)
    # log-probs stay the model's own (raw logits), as for every other logits processing
    assert logprobs is not None and logprobs[0] == pytest.approx(
        float(torch.log_softmax(logits[0], -1)[loser])
    )


def test_repetition_penalty_matches_hf() -> None:
    prompt, output = [3, 7, 7, 11], [20, 3]
    logits = random_logits()
    ours = process_logits(logits[0], make_row(prompt, output, repetition_penalty=1.7))
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())[0]
    assert torch.equal(ours, hf)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = random_logits()
    row = make_row([5, 5, 9], [9, 9, 4], presence_penalty=0.5, frequency_penalty=0.25)
    delta = logits[0] - process_logits(logits[0], row)
    assert delta[9].item() == pytest.approx(0.5 + 2 * 0.25)
    assert delta[4].item() == pytest.approx(0.5 + 0.25)
    assert delta[5].item() == 0.0  # prompt-only token
    assert delta[0].item() == 0.0


def test_bad_words_match_hf() -> None:
    bad = ((8,), (3, 4), (1, 2, 6), (2, 9))
    context = [5, 1, 2]
    logits = random_logits()
    ours = process_logits(logits[0], make_row(context[:1], context[1:], bad_token_ids=bad))
    hf = NoBadWordsLogitsProcessor([list(b) for b in bad], eos_token_id=None)(
        torch.tensor([context]), logits.clone()
    )[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    assert completing_tokens(context, bad) == {8, 6, 9}


def test_min_tokens_bans_end_id_like_hf_and_completing_stop_tokens() -> None:
    logits = random_logits()
    row = make_row([1, 2], [30], min_tokens=3, end_id=7, stop_token_ids=((30, 31), (40,), (12, 13)))
    ours = process_logits(logits[0], row)
    banned = set(torch.nonzero(torch.isinf(ours)).flatten().tolist())
    assert banned == {7, 31, 40}
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=7)
    assert torch.isinf(hf(torch.tensor([[1, 2, 30]]), logits.clone())[0, 7])
    # once min_tokens outputs exist nothing is banned
    assert not torch.isinf(
        process_logits(logits[0], make_row([1, 2], [30, 1, 2], min_tokens=3, end_id=7))
    ).any()


def test_greedy_rows_with_bans_take_the_best_token_they_may_in_one_batch() -> None:
    # Each row's argmax is put where a ban of its own must move it; a row without bans keeps its argmax, and
    # log-probs stay those of the raw logits at the token taken.
    logits = random_logits(4, seed=3)
    logits[0, 7] = logits[1, 8] = logits[2, 31] = 100.0
    rows = [
        make_row([1, 2], [], min_tokens=2, end_id=7, temperature=0.0, logprobs=True),
        make_row([5, 1], [2], bad_token_ids=((8,), (3, 4)), temperature=0.0, logprobs=True),
        make_row(
            [1, 2], [30], min_tokens=3, end_id=7, stop_token_ids=((30, 31),), temperature=0.0, logprobs=True
        ),
        make_row([1, 2], [], temperature=0.0, logprobs=True),
    ]
    before = logits.clone()
    tokens, logprobs = Sampler()(logits, rows)
    assert torch.equal(logits, before)  # the bans went in and came out again
    assert tokens == [int(process_logits(logits[i], row).argmax()) for i, row in enumerate(rows)]
    assert all(token != banned for token, banned in zip(tokens, (7, 8, 31), strict=False))
    assert tokens[3] == int(logits[3].argmax())
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = random_logits()[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1].tolist())
    for i in range(300):
        u = i / 300
        assert sample_from(logits, SamplingParams(top_k=3), u) in top3
        assert sample_from(logits, SamplingParams(top_p=0.6), u) in nucleus


def test_sampling_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.7)
    draws = 4000
    counts = torch.bincount(
        torch.tensor([sample_from(logits, params, (i + 0.5) / draws) for i in range(draws)]), minlength=4
    )
    expected = torch.softmax(logits / 0.7, -1) * draws
    assert torch.allclose(counts.float(), expected, atol=2.0)


def test_seeded_draws_do_not_depend_on_batch_composition() -> None:
    sampler = Sampler()
    target = random_logits(1, seed=5)
    row = make_row([1, 2, 3], [4], temperature=1.0, seed=1234)
    alone = sampler(target, [row])[0]
    others = random_logits(3, seed=6)
    batch = torch.cat([others[:2], target, others[2:]])
    rows = [
        make_row([9], [], temperature=1.0),
        make_row([8], [], temperature=0.0),
        row,
        make_row([7], [], temperature=1.0, seed=99),
    ]
    assert sampler(batch, rows)[0][2] == alone[0]
    # another position of the same request draws a different uniform
    draws = {
        sampler(target, [make_row([1, 2, 3], [4] * n, temperature=1.0, seed=1234)])[0][0] for n in range(20)
    }
    assert len(draws) > 1


def test_speculation_gives_the_same_tokens_as_plain_sampling() -> None:
    """Rows for drafts d0, d1 plus a bonus row: accepted output equals step-by-step sampling."""
    sampler = Sampler()
    logits = random_logits(3, seed=9)
    plain = []
    for i in range(3):
        row = make_row([1, 2], [5] + plain, temperature=1.0, seed=42)
        plain.append(sampler(logits[i : i + 1], [row])[0][0])
    drafts = [plain[0], plain[1]]
    rows = [make_row([1, 2], [5], i, drafts, temperature=1.0, seed=42) for i in range(3)]
    assert accept_drafts(sampler(logits, rows)[0], drafts) == plain
    wrong = [plain[0], (plain[1] + 1) % VOCAB]
    rows = [make_row([1, 2], [5], i, wrong, temperature=1.0, seed=42) for i in range(3)]
    assert accept_drafts(sampler(logits, rows)[0], wrong) == plain[:2]


def test_accept_drafts() -> None:
    assert accept_drafts([4], []) == [4]
    assert accept_drafts([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_drafts([4, 9, 6], [4, 5]) == [4, 9]
    assert accept_drafts([3, 5, 6], [4, 5]) == [3]


def test_masked_tokens_are_never_sampled() -> None:
    logits = torch.full((VOCAB,), -math.inf)
    logits[17] = 0.0
    assert {sample_from(logits, SamplingParams(), u / 10) for u in range(10)} == {17}


@pytest.mark.parametrize("spread", [3.0, 0.05], ids=["peaked", "flat-needs-full-sort"])
def test_top_p_keeps_hf_nucleus(spread: float) -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * spread
    kept = TopPLogitsWarper(0.9)(torch.zeros(1, 1, dtype=torch.int64), logits[None].clone())[0].isfinite()
    drawn = {sample_from(logits, SamplingParams(top_p=0.9), (i + 0.5) / 4000) for i in range(4000)}
    assert all(kept[t] for t in drawn)
    assert len(drawn) >= 0.9 * int(kept.sum())  # the grid of uniforms reaches (nearly) all of it
