"""Draft-model proposer: a smaller model (its own engine directory, built by the same pipeline, sharing
the target's tokenizer) decodes the drafts, one batched forward per draft token, over its own paged KV
cache. Ints and lists here; the draft's ModelRunner does the tensor work.

Each target request has a shadow request on the draft side: same prompt, same sampling params (without
log-probs), token_ids = the target's tokens + the drafts made from them, its own block table in the
draft's BlockManager. Before drafting, the shadow is synced with the target: its token_ids become the
target's, and its computed-token count is rolled back to the longest prefix the two still share (the
accepted drafts; the rejected ones and everything after them are dropped, their blocks trimmed).

NOTE: the shadow samples with the target request's own params, and the sampler keys its randomness by
(seed, output index), so for seeded sampled requests the draft draws its token with the same uniform the
target will use: the drafts of a good draft model are then accepted often even when sampling, while the
output stays exactly the target's (greedy drafts for greedy requests, as usual).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.runtime.core.block_manager import BlockManager
from pipeline.runtime.core.outputs import ScheduledRequest, SchedulerOutput
from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.core.runner import Runner
from pipeline.runtime.spec_decode.adaptive import AdaptiveDraftLength
from pipeline.runtime.spec_decode.proposer import is_decoding, max_useful_drafts

logger = logging.getLogger(__name__)


@dataclass
class _Shadow:
    target: Request
    draft: Request  # the draft model's view: block_table in the draft cache, num_computed_tokens there
    num_synced: int = 0  # leading tokens of draft.token_ids copied from the target at the last sync


class DraftModelProposer:
    """`runner` executes the draft model (a ModelRunner over the draft engine, or any Runner);
    `max_positions` is the longest sequence its RoPE table and cache may hold (None = no limit)."""

    def __init__(
        self, runner: Runner, max_draft_len: int, adaptive: bool = True, max_positions: int | None = None
    ) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.tokens_per_block)
        self.draft_len = AdaptiveDraftLength(max_draft_len, adaptive)
        self.max_positions = max_positions
        self._shadows: dict[str, _Shadow] = {}

    def propose(self, requests: Sequence[Request]) -> None:
        decoding = [r for r in requests if is_decoding(r)]
        self._release_all_but({r.request_id for r in decoding})
        self.draft_len.retain(r.request_id for r in decoding)
        wanted: list[tuple[_Shadow, int]] = []
        for request in decoding:
            request.draft_token_ids = []
            num_drafts = min(self.draft_len.next_len(request), max_useful_drafts(request))
            shadow = self._sync(request)
            num_drafts = self._reserve(shadow, num_drafts)
            if num_drafts:
                wanted.append((shadow, num_drafts))
        if not wanted:
            return
        try:
            self._decode(wanted)
        except Exception:
            # Drafts only save time: a failing draft model must not fail the target's requests. The
            # drafts made so far stay (any draft is safe to verify); the draft side starts over.
            logger.exception("draft model failed; drafting restarts from scratch")
            self.release_all()

    @property
    def num_tracked_requests(self) -> int:
        return len(self._shadows)

    def release_all(self) -> None:
        """Drop every shadow and its draft-cache blocks; drafting starts over from the prompts."""
        self._release_all_but(set())

    def _release_all_but(self, keep: set[str]) -> None:
        for request_id in [rid for rid in self._shadows if rid not in keep]:
            self.block_manager.free(self._shadows.pop(request_id).draft)

    def _sync(self, target: Request) -> _Shadow:
        shadow = self._shadows.get(target.request_id)
        if shadow is None or shadow.target is not target:
            if shadow is not None:  # a new request reusing a finished one's id
                self.block_manager.free(shadow.draft)
            # The draft only proposes tokens: none of the target's log-prob or logits outputs apply to it.
            params = dataclasses.replace(
                target.sampling_params, logprobs=False, context_logits=False, generation_logits=False
            )
            draft = Request(target.request_id, list(target.prompt_token_ids), params, RequestStatus.RUNNING)
            shadow = self._shadows[target.request_id] = _Shadow(target, draft)
        draft, token_ids = shadow.draft, target.token_ids
        # The target's tokens only grow, so only what followed the last sync can differ.
        num_shared = shadow.num_synced + _num_shared_tokens(
            draft.token_ids[shadow.num_synced :], token_ids[shadow.num_synced :]
        )
        del draft.token_ids[num_shared:]
        draft.token_ids.extend(token_ids[num_shared:])
        shadow.num_synced = len(token_ids)
        # K/V computed for tokens past the shared prefix belong to rejected drafts.
        draft.num_computed_tokens = min(draft.num_computed_tokens, num_shared)
        self.block_manager.trim(draft, draft.num_computed_tokens)
        return shadow

    def _reserve(self, shadow: _Shadow, num_drafts: int) -> int:
        """Blocks for the catch-up tokens plus the drafts fed back in; fewer drafts (maybe none) when the
        draft cache or its positions run out."""
        draft = shadow.draft
        if self.max_positions is not None:
            num_drafts = min(num_drafts, self.max_positions - draft.num_tokens + 1)
        bm = self.block_manager
        num_behind = draft.num_tokens - draft.num_computed_tokens
        while num_drafts > 0 and not bm.can_append(draft, num_behind + num_drafts - 1):
            num_drafts -= 1
        if num_drafts <= 0:
            return 0
        bm.append_slots(draft, num_behind + num_drafts - 1)
        return num_drafts

    def _decode(self, wanted: list[tuple[_Shadow, int]]) -> None:
        """Greedy/sampled decode of each shadow's drafts: the first forward catches the shadow up with
        its target (the tokens accepted or sampled since the last draft, or the whole prompt), each
        further one feeds back the previous draft token."""
        for step in range(max(num for _, num in wanted)):
            active = [shadow for shadow, num in wanted if num > step]
            scheduled = [
                ScheduledRequest(s.draft, s.draft.num_tokens - s.draft.num_computed_tokens, sample=True)
                for s in active
            ]
            output = self.runner.execute(SchedulerOutput(scheduled))
            for shadow, sched, sampled in zip(active, scheduled, output.sampled_token_ids, strict=True):
                if len(sampled) != 1:
                    raise RuntimeError(f"draft runner returned {len(sampled)} tokens for one sampled row")
                shadow.draft.num_computed_tokens += sched.num_new_tokens
                shadow.draft.token_ids.append(sampled[0])
                shadow.target.draft_token_ids.append(sampled[0])


def _num_shared_tokens(a: list[int], b: list[int]) -> int:
    num = min(len(a), len(b))
    for i in range(num):
        if a[i] != b[i]:
            return i
    return num
