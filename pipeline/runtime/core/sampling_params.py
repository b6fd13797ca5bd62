"""Per-request sampling settings, validated on construction so a bad request fails before it is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (vLLM's rule, its _SAMPLING_EPS:
# vllm-project/vllm:vllm/sampling_params.py@db573835d3ef40643442e0817059e087355cf458).
# NOTE: the sampler divides the logits by the temperature; at 1e-38 a logit of 4 already overflows fp32 to
# inf and the softmax turns inf - inf into nan, so a tiny temperature sampled garbage, not the one-hot
# distribution it approximates. Its limit is the argmax, which is what these requests get.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. Greedy when `temperature < MIN_SAMPLING_TEMPERATURE` (0 included) or `top_k == 1`."""

    max_tokens: int = 16  # output tokens at most (TRT-LLM: request_output_len)
    min_tokens: int = 0  # end_id and stop sequences are ignored before this many outputs
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k restriction
    top_p: float = 1.0  # 1.0 = no nucleus restriction
    repetition_penalty: float = (
        1.0  # HF-style: divides positive logits of seen tokens, multiplies negative ones
    )
    presence_penalty: float = 0.0  # subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    end_id: int | None = None  # stop when this token is sampled (kept in the output, like HF)
    stop_token_ids: tuple[tuple[int, ...], ...] = ()  # stop sequences; the matched tokens stay in the output
    bad_token_ids: tuple[tuple[int, ...], ...] = ()  # sequences that may never be completed
    seed: int | None = None  # per-request generator seed; None = engine's global generator
    logprobs: bool = False  # return the log-probability of every sampled token
    # TensorRT-LLM's return_context_logits / return_generation_logits: the raw logits of every prompt
    # position ([prompt, vocab]) / of every generated step ([output, vocab]), for scoring and top-k log-probs
    context_logits: bool = False
    generation_logits: bool = False
    # (token id, value) pairs added to the logits before anything else (TensorRT-LLM's embedding_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Set by the speculative-decoding path only; opt-out for requests whose output must not use drafts.
    allow_speculation: bool = field(default=True)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"<= max_tokens ({self.max_tokens})",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0"
        )
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0")
        _check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "> 0",
        )
        _check(math.isfinite(self.presence_penalty), "presence_penalty", self.presence_penalty, "finite")
        _check(math.isfinite(self.frequency_penalty), "frequency_penalty", self.frequency_penalty, "finite")
        for token, value in self.logit_bias:
            _check(
                token >= 0 and math.isfinite(value), "logit_bias", (token, value), "ids >= 0, finite values"
            )
        for name, seqs in (("stop_token_ids", self.stop_token_ids), ("bad_token_ids", self.bad_token_ids)):
            for seq in seqs:
                _check(len(seq) > 0 and all(t >= 0 for t in seq), name, seq, "non-empty, ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming the field if a token id is outside the model's vocabulary: the sampler
        would index the logits with it (an IndexError mid-step), or a stop sequence could never match."""
        limit = f"ids in [0, {vocab_size}) (the model's vocab_size)"
        if self.end_id is not None:
            _check(self.end_id < vocab_size, "end_id", self.end_id, limit)
        for name, seqs in (("stop_token_ids", self.stop_token_ids), ("bad_token_ids", self.bad_token_ids)):
            for seq in seqs:
                _check(all(0 <= t < vocab_size for t in seq), name, seq, limit)
        for token, value in self.logit_bias:
            _check(token < vocab_size, "logit_bias", (token, value), limit)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a bias change the logits themselves (bans only mask tokens)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


def _check(ok: bool, name: str, value: object, limit: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {limit}")
