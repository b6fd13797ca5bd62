"""When a request is done: end_id, stop sequences, max_tokens and max_seq_len, over plain ints."""

from __future__ import annotations

from pipeline.runtime.core.request import RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams


def check_stop(
    token_ids: list[int], num_prompt_tokens: int, params: SamplingParams, max_seq_len: int
) -> RequestStatus | None:
    """The finished status after `token_ids[-1]` was appended, or None to keep going.

    Called once per appended token so that a multi-token step (speculative decoding) stops at the exact
    token that ends the request. A stop is reported before a length limit reached by the same token.
    """
    num_output_tokens = len(token_ids) - num_prompt_tokens
    # NOTE: min_tokens counts outputs the way vLLM does: a stop may end the request once it holds
    # min_tokens outputs, never earlier (the sampler also masks end_id before that point).
    if num_output_tokens >= params.min_tokens and num_output_tokens > 0:
        if params.end_id is not None and token_ids[-1] == params.end_id:
            return RequestStatus.FINISHED_STOPPED
        for stop in params.stop_token_ids:
            if num_output_tokens >= len(stop) and _ends_with(token_ids, stop):
                return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens or len(token_ids) >= max_seq_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def _ends_with(token_ids: list[int], suffix: tuple[int, ...]) -> bool:
    offset = len(token_ids) - len(suffix)
    return all(token_ids[offset + i] == t for i, t in enumerate(suffix))
