"""Proposers draft the next tokens of decoding requests as plain ints on `request.draft_token_ids`; the
scheduler budgets them and the model runner verifies them (see the package docstring). Ints and lists
only; the draft-model proposer, which runs a model, lives in draft_model.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.spec_decode.adaptive import AdaptiveDraftLength


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request]) -> None:
        """Called by the engine before every schedule() with the running requests. Sets
        `draft_token_ids` (at most max_draft_len ints, possibly none) on those about to decode, and may
        drop whatever it keeps for requests not passed (finished, preempted or aborted)."""
        ...


def is_decoding(request: Request) -> bool:
    """Running, with only the last sampled token left to compute, and drafts allowed."""
    return (
        request.status == RequestStatus.RUNNING
        and request.num_tokens - request.num_computed_tokens == 1
        and request.sampling_params.allow_speculation
    )


def max_useful_drafts(request: Request) -> int:
    """Drafts that can still become output: a step adds the accepted drafts plus one token, and the
    request may add max_tokens outputs in all."""
    return max(0, request.sampling_params.max_tokens - request.num_output_tokens - 1)


@dataclass
class _NgramIndex:
    """Most recent start of every n-gram of a request's tokens that has at least one token after it."""

    request: Request  # the indexed request (ids of finished requests may be reused)
    last_start: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in last_start


class NgramProposer:
    """Prompt lookup: the last n tokens (n from max_match down to min_match) are looked up in the
    request's earlier prompt + output tokens, and the tokens that followed their most recent earlier
    occurrence are the draft. No model: it pays off where the output copies the input (editing code,
    summaries quoting the source, retrieval answers)."""

    def __init__(self, max_draft_len: int, min_match: int = 1, max_match: int = 3, adaptive: bool = True):
        if not 1 <= min_match <= max_match:
            raise ValueError(
                f"ngram min_match={min_match} max_match={max_match} is invalid: need 1 <= min_match <= max_match"
            )
        self.min_match = min_match
        self.max_match = max_match
        self.draft_len = AdaptiveDraftLength(max_draft_len, adaptive)
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[Request]) -> None:
        decoding = [r for r in requests if is_decoding(r)]
        live = {r.request_id for r in decoding}
        self.draft_len.retain(live)
        self._indexes = {rid: index for rid, index in self._indexes.items() if rid in live}
        for request in decoding:
            num_drafts = min(self.draft_len.next_len(request), max_useful_drafts(request))
            request.draft_token_ids = self.lookup(request, num_drafts) if num_drafts else []

    def lookup(self, request: Request, num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens continuing the longest suffix match; [] when nothing matches."""
        token_ids = request.token_ids
        index = self._indexes.get(request.request_id)
        if index is None or index.request is not request:
            index = self._indexes[request.request_id] = _NgramIndex(request)
        self._extend(index, token_ids)
        num_tokens = len(token_ids)
        for n in range(min(self.max_match, num_tokens - 1), self.min_match - 1, -1):
            start = index.last_start.get(tuple(token_ids[num_tokens - n :]))
            if start is None:
                continue
            # The copy may run past the last token into the draft itself (an overlapping copy), which
            # continues a repeating pattern instead of stopping at the end of the context.
            draft: list[int] = []
            for i in range(start + n, start + n + num_drafts):
                draft.append(token_ids[i] if i < num_tokens else draft[i - num_tokens])
            return draft
        return []

    def _extend(self, index: _NgramIndex, token_ids: list[int]) -> None:
        # n-grams ending at `end` (exclusive) need token_ids[end] after them: end < len(token_ids).
        for end in range(max(index.num_indexed, self.min_match), len(token_ids)):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                index.last_start[tuple(token_ids[end - n : end])] = end - n
        index.num_indexed = max(index.num_indexed, len(token_ids))
