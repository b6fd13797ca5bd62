"""Log-probabilities as OpenAI returns them, from what the BLS sends: each sampled token's log-prob
(`output_log_probs`, with its id in `output_ids`), and, only when alternatives are asked for, the raw
logits (`generation_logits` per generated step, `context_logits` per prompt position for `echo`), turned
into log-probs and top-k here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# OpenAI's cap on top_logprobs (chat) and logprobs (completions).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token, which nothing predicts
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """[rows, vocab] fp32 -> log-probs, computed in float64 so that equal inputs give equal outputs."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    ids = np.argpartition(-row, k - 1)[:k]
    ids = ids[np.argsort(-row[ids], kind="stable")]
    return [(int(i), float(row[i])) for i in ids]


def generated(
    token_ids: Sequence[int], logprobs: Sequence[float], logits: np.ndarray | None, k: int
) -> list[TokenLogprob]:
    """Generated tokens: their log-probs as sampled, and the top `k` from their steps' raw logits
    ([tokens, vocab], needed only when k > 0)."""
    if logits is None or k <= 0:
        return [TokenLogprob(int(t), float(lp), []) for t, lp in zip(token_ids, logprobs, strict=True)]
    # The token's own log-prob from the same rows as its alternatives, so that a greedy token's value
    # equals the best alternative's exactly (lm-eval's is_greedy compares them).
    rows = _log_softmax(logits)
    return [TokenLogprob(int(t), float(rows[i, t]), _top(rows[i], k)) for i, t in enumerate(token_ids)]


def prompt_logprobs(token_ids: Sequence[int], context_logits: np.ndarray, k: int) -> list[TokenLogprob]:
    """Prompt tokens scored by the model ([prompt, vocab] logits; row i predicts token i + 1)."""
    rows = _log_softmax(context_logits[: len(token_ids) - 1])
    scored = [
        TokenLogprob(int(t), float(rows[i - 1, t]), _top(rows[i - 1], k))
        for i, t in enumerate(token_ids)
        if i
    ]
    return [TokenLogprob(int(token_ids[0]), None, []), *scored]


class Formatter:
    """Token strings as a response shows them: each token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def completion(self, tokens: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """/v1/completions' `logprobs`: parallel lists, `text_offset` counted from `offset`."""
        strings = [self.text(t.token_id) for t in tokens]
        offsets = np.cumsum([offset] + [len(s) for s in strings[:-1]]).tolist() if strings else []
        return {
            "tokens": strings,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {self.text(i): lp for i, lp in t.top} if t.logprob is not None else None for t in tokens
            ],
            "text_offset": [int(o) for o in offsets],
        }

    def chat(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """/v1/chat/completions' `logprobs`: one entry per token with its alternatives."""
        return {
            "content": [
                {
                    **self._entry(t.token_id, t.logprob if t.logprob is not None else 0.0),
                    "top_logprobs": [self._entry(i, lp) for i, lp in t.top],
                }
                for t in tokens
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class LogprobsView:
    """A choice's `logprobs` objects, delta by delta (completions' text offsets run on across deltas)."""

    def __init__(self, tokenizer: Any, chat: bool, offset: int = 0) -> None:
        self.formatter = Formatter(tokenizer)
        self.chat = chat
        self.offset = offset

    def render(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return self.formatter.chat(tokens)
        shown = self.formatter.completion(tokens, self.offset)
        self.offset += sum(len(s) for s in shown["tokens"])
        return shown
