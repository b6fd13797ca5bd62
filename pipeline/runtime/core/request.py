"""A request's state inside the engine. Ints and lists only: no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.runtime.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, or preempted and waiting to be recomputed
    RUNNING = 1
    FINISHED_STOPPED = 2  # end_id or a stop sequence
    FINISHED_LENGTH = 3  # max_tokens or max_seq_len
    FINISHED_ABORTED = 4  # cancelled by the caller
    FINISHED_ERROR = 5  # failed alone; other requests go on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestStats:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_blocks_allocated: int = 0  # fresh blocks taken from the free list over the request's life
    num_blocks_reused: int = 0  # blocks shared through prefix reuse
    num_blocks_released: int = 0  # blocks given back early, once outside the attention window
    num_cached_tokens: int = 0  # prompt tokens served from reused blocks at first admission
    num_draft_tokens: int = 0  # speculative tokens proposed
    num_accepted_draft_tokens: int = 0  # of those, accepted by the target

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    # prompt + generated tokens; the tail may hold tokens whose KV is not yet computed
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # sampling_params.context_logits: the prompt's logits rows so far, in position order (opaque float arrays
    # [rows, vocab] made by the runner; passed on untouched)
    context_logits: list[Any] = field(default_factory=list)
    num_context_logits: int = 0  # prompt positions covered by context_logits
    # tokens whose K/V are written in the cache (prefix hits included)
    num_computed_tokens: int = 0
    # physical KV block ids, in order; written only by BlockManager
    block_table: list[int] = field(default_factory=list)
    # leading block_table entries released because every layer's attention window has moved past them
    # (their ids are stale: no attention reads positions there again)
    num_released_blocks: int = 0
    # speculative draft for the next step; written by the proposer, cleared by the engine
    draft_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def add_context_logits(self, start: int, rows: Any) -> None:
        """Keep a step's prompt logits (positions [start, start + len(rows))); positions already held
        (recomputed after a preemption) are skipped."""
        new_rows = rows[self.num_context_logits - start :]
        if start <= self.num_context_logits and len(new_rows):
            self.context_logits.append(new_rows)
            self.num_context_logits += len(new_rows)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
