"""Per-request draft length that follows the request's own acceptance: ints only.

A rejected draft still costs its verification (one more token per draft in the target's forward), so a
request whose drafts keep failing should stop drafting, and one whose drafts keep passing should draft
more. The length doubles after a step whose drafts were all accepted and drops to the number accepted
after a rejection; a step that accepted nothing also pauses drafting for `backoff` steps, and the pause
doubles (up to MAX_BACKOFF_STEPS) while nothing is accepted, so on a workload where drafts always fail
the verification overhead fades to one draft every MAX_BACKOFF_STEPS steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.runtime.core.request import Request

MAX_BACKOFF_STEPS = 32


@dataclass
class _State:
    draft_len: int
    # request.stats counters when last read: their growth is what the scheduler verified since
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_paused_steps: int = 0  # steps left without drafting
    backoff: int = 1  # the next pause, in steps


class AdaptiveDraftLength:
    """How many tokens to draft for each request this step, from 0 to `max_draft_len`; with
    `enabled=False` always `max_draft_len`."""

    def __init__(self, max_draft_len: int, enabled: bool = True) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len={max_draft_len} is invalid: must be >= 1")
        self.max_draft_len = max_draft_len
        self.enabled = enabled
        self._states: dict[str, _State] = {}

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not named (finished, or no longer running)."""
        keep = set(request_ids)
        self._states = {rid: s for rid, s in self._states.items() if rid in keep}

    def next_len(self, request: Request) -> int:
        """The draft length for the request's next step; call once per step it may draft in."""
        if not self.enabled:
            return self.max_draft_len
        stats = request.stats
        state = self._states.get(request.request_id)
        if state is None:
            state = _State(self.max_draft_len, stats.num_draft_tokens, stats.num_accepted_draft_tokens)
            self._states[request.request_id] = state
        num_drafted = stats.num_draft_tokens - state.num_draft_tokens
        num_accepted = stats.num_accepted_draft_tokens - state.num_accepted_draft_tokens
        state.num_draft_tokens, state.num_accepted_draft_tokens = (
            stats.num_draft_tokens,
            stats.num_accepted_draft_tokens,
        )
        if num_drafted:
            _learn(state, num_drafted, num_accepted, self.max_draft_len)
        if state.num_paused_steps:
            state.num_paused_steps -= 1
            return 0
        return state.draft_len


def _learn(state: _State, num_drafted: int, num_accepted: int, max_draft_len: int) -> None:
    if num_accepted == num_drafted:
        state.draft_len = min(max_draft_len, 2 * state.draft_len)
        state.backoff = 1
    elif num_accepted:
        state.draft_len = num_accepted
        state.backoff = 1
    else:
        state.draft_len = 1
        state.num_paused_steps = state.backoff
        state.backoff = min(MAX_BACKOFF_STEPS, 2 * state.backoff)
