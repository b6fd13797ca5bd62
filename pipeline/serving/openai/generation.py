"""One generation as the API sees it: text deltas with stop strings cut out, then a finish reason and the
number of tokens generated. Stop strings are also sent to the engine (it may stop on their tokens), but
the text is what decides: a stop string is matched across deltas and the request is ended there. With
log-probs asked for, each delta carries those of the tokens that arrived with its text (a held-back
text's tokens go with the delta that sends it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.serving.openai.logprobs import TokenLogprob, generated
from pipeline.serving.openai.triton import Piece, TritonBls


class StopMatcher:
    """Holds back text that may be the start of a stop string until the next delta decides."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended the text)."""
        text = self.held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = 0
        for stop in self.stops:  # the longest tail of `text` that begins some stop string
            for size in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:size]):
                    keep = size
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        rest, self.held = self.held, ""
        return rest


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob]  # empty unless asked for


@dataclass
class Outcome:
    """Filled in as the generation runs; complete once the delta iterator is exhausted."""

    completion_tokens: int = 0
    finish_reason: str | None = None
    deltas: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    context_logits: np.ndarray | None = None  # [prompt, vocab], when the body asked for them

    @property
    def text(self) -> str:
        return "".join(self.deltas)


async def generate_deltas(
    bls: TritonBls,
    body: dict[str, Any],
    stops: Sequence[str],
    outcome: Outcome,
    top_logprobs: int | None = None,
) -> AsyncGenerator[Delta, None]:
    """The completion's deltas (text never empty but for a last one that only carries log-probs). `body`
    holds the BLS inputs, max_tokens among them; `top_logprobs`: None for no log-probs, else how many
    alternatives per token."""
    matcher = StopMatcher(stops)
    stopped = False
    pending: list[TokenLogprob] = []
    # aclosing: when this generator is closed early (client gone), the BLS stream is closed too, at once.
    async with contextlib.aclosing(bls.generate(body)) as pieces:
        async for piece in pieces:
            outcome.completion_tokens += piece.num_tokens
            if piece.context_logits is not None:
                outcome.context_logits = piece.context_logits
            if top_logprobs is not None:
                pending += _token_logprobs(piece, top_logprobs)
            text, stopped = matcher.feed(piece.text)
            if text:
                outcome.deltas.append(text)
                yield _delta(text, pending, outcome)
            if stopped:
                break  # leaving the BLS stream cancels the rest of the request
    rest = "" if stopped else matcher.flush()
    if rest or pending:
        outcome.deltas.append(rest)
        yield _delta(rest, pending, outcome)
    hit_limit = outcome.completion_tokens >= int(body["max_tokens"])
    outcome.finish_reason = "length" if hit_limit and not stopped else "stop"


def _token_logprobs(piece: Piece, k: int) -> list[TokenLogprob]:
    return generated(piece.token_ids, piece.log_probs, piece.generation_logits, k)


def _delta(text: str, pending: list[TokenLogprob], outcome: Outcome) -> Delta:
    """A delta taking the pending log-probs along (and emptying the list)."""
    delta = Delta(text, list(pending))
    outcome.logprobs += pending
    pending.clear()
    return delta
