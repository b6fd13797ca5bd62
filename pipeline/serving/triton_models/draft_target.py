"""TensorRT-LLM's draft-target speculative decoding as the BLS drives it (backend trtllm,
speculative.mode=draft_model; triton-inference-server/tensorrtllm_backend:
all_models/inflight_batcher_llm/tensorrt_llm_bls@v0.18.0): each round the draft model generates up to
`num_draft_tokens` tokens after the sequence so far, then the target gets the same sequence with those
tokens as `draft_input_ids` and `request_output_len` = drafts + 1, and returns the drafts it accepted plus
one token of its own. Rounds repeat until the request has its tokens, the target stops (end id, stop word:
a round without a token of its own) or a stop word completes across rounds.

Pure over `call(model, inputs) -> outputs` (numpy dicts, batch dimension 1), so the loop runs without
Triton. Every round is a non-streaming engine request that returns only its new tokens.

The acceptance counts are the loop's own, summed over the rounds (a round's accepted drafts are the
longest common prefix of the drafts and the target's tokens): the target's per-request outputs would
describe only the round they came from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

Call = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]

# Inputs each round sets itself; the client request's values of these never reach the engines.
_PER_ROUND = (
    "input_ids",
    "input_lengths",
    "request_output_len",
    "min_tokens",
    "streaming",
    "exclude_input_in_output",
    "return_perf_metrics",
    "draft_input_ids",
)


@dataclass(frozen=True)
class DraftTargetRequest:
    """One client request, as the loop needs it."""

    engine_inputs: dict[str, np.ndarray]  # the tensorrt_llm tensors of the plain (non-speculative) request
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    num_draft_tokens: int  # per round, >= 1
    end_id: int | None
    stop_words: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Round:
    token_ids: list[int]  # the target's new tokens (cut after a stop word that completes across rounds)
    log_probs: np.ndarray | None  # the target's log-probs of those tokens, when it returned them
    num_draft_tokens: int  # drafts the target verified
    num_accepted_draft_tokens: int


def common_prefix_length(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    count = 0
    for draft, token in zip(drafts, tokens, strict=False):
        if draft != token:
            break
        count += 1
    return count


def new_tokens(outputs: dict[str, np.ndarray]) -> list[int]:
    """The tokens of a round's response (the engine excluded the input)."""
    ids = outputs.get("output_ids")
    if ids is None:
        return []
    count = int(np.asarray(outputs["sequence_length"]).reshape(-1)[0])
    return [int(t) for t in np.asarray(ids).reshape(-1)[:count]]


def _round_inputs(
    request: DraftTargetRequest, sequence: list[int], num_tokens: int, min_tokens: int
) -> dict[str, np.ndarray]:
    inputs = {k: v for k, v in request.engine_inputs.items() if k not in _PER_ROUND}
    inputs.update(
        {
            "input_ids": np.array([sequence], dtype=np.int32),
            "input_lengths": np.array([[len(sequence)]], dtype=np.int32),
            "request_output_len": np.array([[num_tokens]], dtype=np.int32),
            "min_tokens": np.array([[min_tokens]], dtype=np.int32),
            "streaming": np.array([[False]]),
            "exclude_input_in_output": np.array([[True]]),
        }
    )
    return inputs


def _stop_word_end(generated: list[int], num_new: int, stop_words: Sequence[Sequence[int]]) -> int | None:
    """Length of `generated` up to the end of the first stop word completed by its last `num_new` tokens."""
    for end in range(len(generated) - num_new + 1, len(generated) + 1):
        if any(word and generated[max(0, end - len(word)) : end] == list(word) for word in stop_words):
            return end
    return None


def rounds(call: Call, draft_model: str, target_model: str, request: DraftTargetRequest) -> Iterator[Round]:
    """Run the loop; yields each round's result as soon as the target returned it."""
    generated: list[int] = []
    while len(generated) < request.max_tokens:
        sequence = request.prompt_ids + generated
        num_drafts = min(request.num_draft_tokens, request.max_tokens - len(generated) - 1)
        drafts: list[int] = []
        if num_drafts > 0:
            # The draft always fills its budget (min_tokens): whether a draft past the end id counts is
            # the target's call, as in tensorrtllm_backend.
            drafted = call(draft_model, _round_inputs(request, sequence, num_drafts, num_drafts))
            drafts = new_tokens(drafted)[:num_drafts]
        num_wanted = len(drafts) + 1
        min_tokens = min(max(0, request.min_tokens - len(generated)), num_wanted)
        inputs = _round_inputs(request, sequence, num_wanted, min_tokens)
        if drafts:
            inputs["draft_input_ids"] = np.array([drafts], dtype=np.int32)
        verified = call(target_model, inputs)
        tokens = new_tokens(verified)[:num_wanted]
        generated += tokens
        stop_end = _stop_word_end(generated, len(tokens), request.stop_words)
        if stop_end is not None:
            del tokens[len(tokens) - (len(generated) - stop_end) :]
            del generated[stop_end:]
        log_probs = verified.get("output_log_probs")
        num_accepted = common_prefix_length(drafts, tokens)
        yield Round(
            token_ids=tokens,
            log_probs=None if log_probs is None else np.asarray(log_probs).reshape(-1)[: len(tokens)],
            num_draft_tokens=len(drafts),
            num_accepted_draft_tokens=num_accepted,
        )
        # A round that goes on ends with a token of the target's own (after its accepted drafts); none
        # means the target stopped (end id, stop word) inside the drafts.
        ended = len(tokens) <= num_accepted or (request.end_id is not None and request.end_id in tokens)
        if ended or stop_end is not None:
            return
