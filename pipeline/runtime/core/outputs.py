"""The contracts between scheduler, model runner and engine caller. Ints and lists only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.runtime.core.request import Request, RequestStats


@dataclass
class ScheduledRequest:
    """One request's share of an engine step."""

    request: Request
    # tokens to compute this step: request.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens],
    # followed by request.draft_token_ids when num_draft_tokens > 0
    num_new_tokens: int
    # False for a prompt chunk that does not reach the end of the prompt (chunked context): nothing is sampled
    sample: bool
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests that finished (stop, length, abort, error) since the previous step: the runner may drop any
    # per-request state it keeps (e.g. seeded generators); may name a request the runner never saw
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Per scheduled request, in SchedulerOutput order."""

    # [] when sample=False; one token normally; 1..num_draft_tokens+1 accepted tokens with speculation
    sampled_token_ids: list[list[int]]
    # same shape as sampled_token_ids when any request asked for logprobs, else None
    logprobs: list[list[float]] | None = None
    # Logits a request asked for (SamplingParams.context_logits / generation_logits), None elsewhere and
    # when no request asked. The arrays are float32 numpy [rows, vocab]: the scheduler only stores and
    # forwards them.
    context_logits: list[LogitsRows | None] | None = None
    # one row per token in sampled_token_ids
    generation_logits: list[Any | None] | None = None

    @classmethod
    def concat(cls, parts: list[RunnerOutput]) -> RunnerOutput:
        """One output of several single-request outputs, in order (the engine's per-request retry step)."""

        def joined(field: str, missing: Any) -> list[Any] | None:
            values = [getattr(part, field) for part in parts]
            if all(v is None for v in values):
                return None
            return [missing() if v is None else v[0] for v in values]

        return cls(
            sampled_token_ids=[part.sampled_token_ids[0] for part in parts],
            logprobs=joined("logprobs", list),
            context_logits=joined("context_logits", lambda: None),
            generation_logits=joined("generation_logits", lambda: None),
        )


@dataclass
class LogitsRows:
    """The logits of prompt positions [start, start + len(rows)) of one request."""

    start: int
    rows: Any  # numpy float32 [num_rows, vocab]


@dataclass
class RequestOutput:
    """What the engine caller sees for one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from reused KV blocks
    # SamplingParams.context_logits: the prompt's logits in position order, as chunks of [rows, vocab], on
    # the output that brings the first token; else None
    context_logits: list[Any] | None = None
    # SamplingParams.generation_logits: [len(new_token_ids), vocab], else None
    new_generation_logits: Any | None = None
    error: str | None = None
    stats: RequestStats | None = None  # set on the final output only
