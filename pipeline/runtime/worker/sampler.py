"""Token selection from the model's logits: greedy, temperature, top-k, top-p, repetition / presence /
frequency penalties, bad words, min_tokens, per-request seeds and log-probs.

Conventions:
- Processing order follows HF `generate`: repetition penalty, (presence/frequency penalties), bad words,
  min_tokens bans, then temperature, top-k, top-p.
- Log-probs are log_softmax of the RAW model logits at the chosen token (HF's `output_logits`; equal to
  `compute_transition_scores` for greedy without logits processors), so they do not depend on sampling
  settings.
- Randomness is keyed by (seed, output index): the draw for a request's n-th output token comes from a
  generator seeded with mix(seed, n). Output therefore depends only on the seed and the logits, not on
  batch composition, preemption/recompute, or speculative decoding (see `accept_drafts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Tokens considered before falling back to a full sort for top-p (see sample_from).
NUCLEUS_CANDIDATES = 256


@dataclass
class SampleRow:
    """One logits row to sample: the token after request.token_ids + request.draft_token_ids[:num_drafts_before]."""

    request: Request
    num_drafts_before: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def output_index(self) -> int:
        """How many output tokens precede the one being sampled."""
        return self.request.num_output_tokens + self.num_drafts_before

    @property
    def greedy_with_bans_only(self) -> bool:
        """Greedy whose only logits processing is banning tokens (bad words, min_tokens), no log-probs or
        logits wanted: its token is the unprocessed argmax unless that token is banned."""
        p = self.params
        return p.greedy and not p.logprobs and not p.generation_logits and not p.adjusts_logits

    def banned_tokens(self) -> set[int]:
        """The tokens this row may not take (HF's order: bad words, then min_tokens' end id and stop ends)."""
        p = self.params
        before_min = self.output_index < p.min_tokens
        stops = p.stop_token_ids if before_min else ()
        banned = (
            completing_tokens(self.context(), [*p.bad_token_ids, *stops])
            if p.bad_token_ids or stops
            else set()
        )
        if before_min and p.end_id is not None:
            banned.add(p.end_id)
        return banned

    def context(self) -> list[int]:
        """Prompt + output tokens preceding this row's token."""
        return self.request.token_ids + self.request.draft_token_ids[: self.num_drafts_before]


def position_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): well-spread generator seeds for consecutive output positions."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seeded = torch.Generator()  # re-seeded for every draw of a seeded request
        self._unseeded = torch.Generator()  # one stream for requests without a seed
        if seed is None:
            self._unseeded.seed()
        else:
            self._unseeded.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRow]
    ) -> tuple[list[int], list[float] | None]:
        """logits [R, vocab] fp32, one row per SampleRow -> (token ids, log-probs if any row wants them)."""
        want_logprobs = any(r.params.logprobs for r in rows)
        if all(r.params.greedy and not r.params.adjusts_logits for r in rows):
            # Greedy rows that at most ban tokens (min_tokens, bad words): one masked argmax over the batch,
            # not a copy and a mask per row. 16 forced-length streams asking for log-probs (SmolLM2-135M
            # int8, in-process, 2 threads): 723.6 / 709.9 -> 745.5 / 728.3 tok/s.
            tokens = _masked_argmax(logits, rows)
            token_ids = tokens.tolist()
        else:
            token_ids = [self._sample_row(logits[i], row) for i, row in enumerate(rows)]
            tokens = torch.tensor(token_ids, device=logits.device)
        if not want_logprobs:
            return token_ids, None
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return token_ids, logprobs.tolist()

    def _sample_row(self, row_logits: torch.Tensor, row: SampleRow) -> int:
        params = row.params
        logits = process_logits(row_logits, row) if _needs_processing(row) else row_logits
        if params.greedy:
            return int(logits.argmax())
        return sample_from(logits, params, self._uniform(row))

    def _uniform(self, row: SampleRow) -> float:
        seed = row.params.seed
        if seed is None:
            return float(torch.rand((), generator=self._unseeded))
        self._seeded.manual_seed(position_seed(seed, row.output_index))
        return float(torch.rand((), generator=self._seeded))


def _masked_argmax(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Each row's argmax over the tokens it may take (the first on ties). The bans go into `logits` and come
    out again, instead of onto a copy of it. max(dim) gives argmax's indices: on CPU it took a third of
    argmax's time for 16 rows of a 49k vocabulary (0.20 against 0.60 ms)."""
    bans = [(i, token) for i, row in enumerate(rows) for token in row.banned_tokens()]
    if not bans:
        return logits.max(dim=-1).indices
    at = torch.tensor(bans, dtype=torch.int64, device=logits.device)
    rows_at, tokens_at = at[:, 0], at[:, 1]
    kept = logits[rows_at, tokens_at]
    logits[rows_at, tokens_at] = float("-inf")
    tokens = logits.max(dim=-1).indices
    logits[rows_at, tokens_at] = kept
    return tokens


def _needs_processing(row: SampleRow) -> bool:
    p = row.params
    return p.adjusts_logits or bool(p.bad_token_ids) or row.output_index < p.min_tokens


def process_logits(row_logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Bias, penalties and bans on a copy of one row of logits [vocab]."""
    p = row.params
    logits = row_logits.clone()
    context = row.context()
    num_prompt = row.request.num_prompt_tokens
    device = logits.device
    if p.logit_bias:
        ids, values = zip(*p.logit_bias, strict=True)
        logits[torch.tensor(ids, dtype=torch.int64, device=device)] += torch.tensor(
            values, dtype=logits.dtype, device=device
        )
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(context)), dtype=torch.int64, device=device)
        scores = logits[seen]
        logits[seen] = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(context) > num_prompt:
        output = torch.tensor(context[num_prompt:], dtype=torch.int64, device=device)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    banned = row.banned_tokens()
    if banned:
        logits[torch.tensor(sorted(banned), dtype=torch.int64, device=device)] = float("-inf")
    return logits


def completing_tokens(context: list[int], sequences: Sequence[Sequence[int]]) -> set[int]:
    """The tokens that would complete one of `sequences` right after `context` (HF's bad-words rule: a
    sequence's last token is banned when the context ends with the rest of it)."""
    banned = set()
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or context[len(context) - len(prefix) :] == prefix:
            banned.add(seq[-1])
    return banned


def sample_from(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """Temperature, then top-k, then top-p (nucleus), then inverse-CDF sampling with `uniform` in [0, 1)."""
    scaled = logits / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        values, indices = torch.topk(scaled, params.top_k)  # sorted, descending
        log_norm = torch.logsumexp(values, dim=-1)  # top-p then applies to the renormalized top-k
    elif params.top_p < 1.0:
        # Sorting the whole vocabulary costs milliseconds per row; the nucleus nearly always lies in the
        # top few hundred tokens, which is exact whenever their mass already reaches top_p.
        log_norm = torch.logsumexp(scaled, dim=-1)
        values, indices = torch.topk(scaled, min(vocab, NUCLEUS_CANDIDATES))
        if float(torch.exp(values - log_norm).sum()) < params.top_p:
            values, indices = torch.sort(scaled, descending=True)
    else:
        values, indices, log_norm = scaled, None, torch.logsumexp(scaled, dim=-1)
    probs = torch.exp(values - log_norm)
    if params.top_p < 1.0:
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p (always the first one).
        preceding = probs.cumsum(-1) - probs
        probs = probs.masked_fill(preceding >= params.top_p, 0.0)
    cdf = probs.cumsum(-1)
    target = torch.tensor(uniform, dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    choice = min(int(torch.searchsorted(cdf, target, right=True)), cdf.shape[0] - 1)
    return int(indices[choice]) if indices is not None else choice


def accept_drafts(sampled: list[int], draft_token_ids: Sequence[int]) -> list[int]:
    """Verify speculative drafts: sampled[i] is the target's token after drafts[:i] (sampled[-1] follows
    all drafts). Accept drafts while they equal the target's token; the first mismatch is replaced by the
    target's token, and when every draft matches the target's next token is a bonus.

    NOTE: with the target token drawn exactly as without speculation (same keyed uniform), accepting a
    draft iff it equals that token accepts draft d with probability p(d) and otherwise yields x ~ p(x)
    restricted to x != d: the rejection-sampling rule for a deterministic (one-hot) draft. Output is thus
    identical with and without speculation, greedy or sampled.
    """
    accepted = []
    for i, token in enumerate(sampled):
        accepted.append(token)
        if i >= len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return accepted
