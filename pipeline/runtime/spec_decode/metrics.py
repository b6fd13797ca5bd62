"""Per-request speculative-decoding figures, from the counters the scheduler keeps in RequestStats:
TensorRT-LLM's `acceptance_rate` / `total_accepted_draft_tokens` / `total_draft_tokens` outputs, plus
the accepted tokens per decode step."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.runtime.core.request import RequestStats


@dataclass(frozen=True)
class SpecDecodeStats:
    num_draft_tokens: int  # drafts the target verified
    num_accepted_draft_tokens: int  # of those, accepted
    # target steps that produced this request's outputs after the first (which comes from the prefill);
    # each adds its accepted drafts plus one token of its own
    num_decode_steps: int

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def accepted_tokens_per_step(self) -> float | None:
        """Accepted drafts per decode step; the step's tokens are this plus one."""
        return self.num_accepted_draft_tokens / self.num_decode_steps if self.num_decode_steps else None


def spec_decode_stats(stats: RequestStats, num_output_tokens: int) -> SpecDecodeStats:
    """From a request's stats and output count (Request, or a final RequestOutput's `stats` and
    `num_output_tokens`).

    NOTE: the step count is derived (outputs - 1 - accepted drafts); when a stop cut accepted drafts off
    the last step, it is short by the number cut.
    """
    num_accepted = stats.num_accepted_draft_tokens
    return SpecDecodeStats(
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_draft_tokens=num_accepted,
        num_decode_steps=max(0, num_output_tokens - 1 - num_accepted),
    )
