"""The llmapi model's tensors <-> the torch engine: text and `sampling_param_*` in, text out. No Triton here.

Names, types and defaults are TensorRT-LLM's llmapi Triton model's (NVIDIA/TensorRT-LLM:
triton_backend/all_models/llmapi/tensorrt_llm/{config.pbtxt@0a71057, 1/helpers.py@0df60f9, 1/model.py@044a90d})
and those of the LLM API's SamplingParams behind it (tensorrt_llm/sampling_params.py@000a01d):

- max_tokens defaults to 32; decoding is greedy when temperature, top_k and top_p are all unset, or when
  top_k is 1, top_p is 0 or temperature is 0; otherwise unset ones mean temperature 1, no top-k, no top-p.
- `sampling_param_stop` strings are tokenized and stop generation when the output ends with their tokens;
  those tokens are left out of text_output, and stop_reason names the string.
- text_output is the text generated so far: each streamed response carries all of it (the LLM API's
  CompletionOutput.text accumulates, tensorrt_llm/executor/result.py@005bc84), the last one the whole
  completion. Non-streaming, the prompt comes first unless sampling_param_exclude_input_from_output is
  true (upstream's default is false; serving.exclude_input_in_output changes it here).
- finish_reason is "stop", "length" or "cancelled", and "None" on streamed responses before the last;
  stop_reason is the stop string, else "None" (upstream sends both as str() of the LLM API's values).
  Each is sent only when its return_* input asks for it, and cumulative_logprob likewise.
- sampling_param_return_perf_metrics adds the KV-reuse, timing and speculative-decoding outputs to the
  final response (times are steady-clock nanoseconds, as upstream's).

Inputs the torch engine cannot honour (image_url, lora_*, best_of > 1) are refused with an error naming the
input. Inputs arrive without a batch dimension (model.yaml: triton_config.max_batch_size 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.runtime.core.outputs import RequestOutput
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.detokenizer import IncrementalDetokenizer, decode_all
from pipeline.serving.triton_models.io import (
    EngineRequest,
    InvalidInputError,
    RequestLimits,
    StopRequest,
    check_output_len,
    check_streamable,
    flag,
    scalar,
    speculative_outputs,
)
from pipeline.serving.triton_models.streams import Reply, RequestState, ResponseGroup
from pipeline.serving.triton_models.tokenization import PromptEncoder, decode_words

Inputs = Mapping[str, np.ndarray]

LLMAPI_INPUTS = (
    "text_input", "image_url", "streaming",
    "sampling_param_best_of", "sampling_param_temperature", "sampling_param_top_k", "sampling_param_top_p",
    "sampling_param_frequency_penalty", "sampling_param_presence_penalty", "sampling_param_max_tokens",
    "sampling_param_stop", "sampling_param_seed", "sampling_param_exclude_input_from_output",
    "sampling_param_return_perf_metrics",
    "return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop",
    "lora_id", "lora_name", "lora_path", "lora_ckpt_source",
)  # fmt: skip
DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams.max_tokens
# Inputs refused whenever they are sent (an empty image_url list sends nothing).
REFUSED = {
    "image_url": "the torch engine serves text-only models",
    "lora_id": "the torch engine serves no LoRA adapters",
    "lora_name": "the torch engine serves no LoRA adapters",
    "lora_path": "the torch engine serves no LoRA adapters",
}
# Inputs honoured only at upstream's default: (that default, why anything else is refused).
UNSUPPORTED_AT_DEFAULT: dict[str, tuple[object, str]] = {
    "sampling_param_best_of": (
        1,
        "the torch engine returns one sequence and has no best-of or beam search: send 1",
    ),
    "lora_ckpt_source": ("hf", "the torch engine serves no LoRA adapters"),
}
# The engine's finish reasons as the LLM API names them (CompletionOutput.finish_reason).
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}
NOT_FINISHED = str(None)  # what upstream sends for a value the LLM API has not set


@dataclass(frozen=True)
class LlmApiRequest(EngineRequest):
    stop_words: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (string, its tokens), in the client's order
    end_ids: tuple[int, ...] = ()  # tokens that end the completion (left out of text_output)
    return_finish_reason: bool = False
    return_stop_reason: bool = False
    return_cumulative_logprob: bool = False


def _refuse_unsupported(inputs: Inputs) -> None:
    for name, why in REFUSED.items():
        if name in inputs and np.asarray(inputs[name]).size:
            raise InvalidInputError(name, inputs[name], why)
    for name, (default, why) in UNSUPPORTED_AT_DEFAULT.items():
        if name not in inputs:
            continue
        value = decode_words(name, inputs.get(name))[0] if isinstance(default, str) else scalar(inputs, name)
        if value != default:
            raise InvalidInputError(name, value, why)


def _sampling(inputs: Inputs) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) by the LLM API's rules (greedy = temperature 0)."""
    temperature, top_k, top_p = (
        scalar(inputs, f"sampling_param_{name}") for name in ("temperature", "top_k", "top_p")
    )
    if temperature is not None and temperature < 0:
        raise InvalidInputError("sampling_param_temperature", temperature, "must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 0:
        raise InvalidInputError("sampling_param_top_k", top_k, "must be >= 0 (0 = no top-k limit)")
    if top_p is not None and not 0 <= top_p <= 1:
        raise InvalidInputError("sampling_param_top_p", top_p, "must be in [0, 1]")
    unset = temperature is None and top_k is None and top_p is None
    if unset or top_k == 1 or top_p == 0 or temperature == 0:
        return 0.0, 0, 1.0
    return (
        1.0 if temperature is None else float(temperature),
        int(top_k or 0),
        1.0 if top_p is None else float(top_p),
    )


def _prompt(inputs: Inputs, encoder: PromptEncoder) -> list[int]:
    texts = inputs.get("text_input")
    if texts is None:
        raise InvalidInputError("text_input", None, "required: the prompt")
    if np.asarray(texts).size != 1:
        raise InvalidInputError(
            "text_input", f"{np.asarray(texts).size} prompts", "send one prompt per request"
        )
    return encoder.encode_prompt(decode_words("text_input", inputs.get("text_input"))[0])


def _stop_words(inputs: Inputs, encoder: PromptEncoder) -> tuple[tuple[str, tuple[int, ...]], ...]:
    words = []
    for word in decode_words("sampling_param_stop", inputs.get("sampling_param_stop")):
        if not word:
            continue
        ids = encoder.encode_word(word)
        if not ids:
            raise InvalidInputError("sampling_param_stop", word, "encodes to no tokens")
        words.append((word, ids))
    return tuple(words)


def parse_llmapi_request(
    inputs: Inputs,
    encoder: PromptEncoder,
    limits: RequestLimits,
    *,
    default_exclude_input: bool,
    decoupled: bool,
) -> LlmApiRequest | StopRequest:
    """Validate an llmapi request; raises InvalidInputError naming the input, its value and the limit."""
    if flag(inputs, "stop"):
        return StopRequest()
    _refuse_unsupported(inputs)
    prompt = _prompt(inputs, encoder)
    max_tokens = scalar(inputs, "sampling_param_max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    check_output_len("sampling_param_max_tokens", max_tokens, len(prompt), limits)
    streaming = flag(inputs, "streaming")
    check_streamable(streaming, decoupled, "streaming=false")
    seed = scalar(inputs, "sampling_param_seed")
    temperature, top_k, top_p = _sampling(inputs)
    stop_words = _stop_words(inputs, encoder)
    return_cumulative_logprob = flag(inputs, "return_cumulative_logprob")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            end_id=encoder.end_id if encoder.end_id >= 0 else None,
            stop_token_ids=(
                *(ids for _, ids in stop_words),
                *(tuple(s) for s in encoder.default_stop_sequences(None)),
            ),
            seed=None if seed is None else int(seed),
            logprobs=return_cumulative_logprob,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            presence_penalty=float(scalar(inputs, "sampling_param_presence_penalty") or 0.0),
            frequency_penalty=float(scalar(inputs, "sampling_param_frequency_penalty") or 0.0),
        )
    except ValueError as err:  # a value SamplingParams rejects; its message names the field
        raise InvalidInputError("sampling_param", "(combination)", str(err)) from None
    return LlmApiRequest(
        prompt,
        params,
        streaming,
        flag(inputs, "sampling_param_exclude_input_from_output", default_exclude_input),
        return_perf_metrics=flag(inputs, "sampling_param_return_perf_metrics"),
        stop_words=stop_words,
        end_ids=tuple(encoder.end_ids),
        return_finish_reason=flag(inputs, "return_finish_reason"),
        return_stop_reason=flag(inputs, "return_stop_reason"),
        return_cumulative_logprob=return_cumulative_logprob,
    )


def _ns(seconds: float | None) -> np.ndarray:
    return np.array([0 if seconds is None else round(seconds * 1e9)], dtype=np.int64)


class LlmApiState(RequestState):
    """One llmapi request: engine outputs in, text responses out."""

    request: LlmApiRequest

    def __init__(
        self,
        engine_id: str,
        request: LlmApiRequest,
        sender: Any,
        tokenizer: Any,
        *,
        skip_special_tokens: bool,
        tokens_per_block: int,
        timeout_s: float | None = None,
        group: ResponseGroup | None = None,
    ) -> None:
        super().__init__(engine_id, request, sender, timeout_s=timeout_s, group=group)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens_per_block = tokens_per_block
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids, skip_special_tokens)
        self.text = ""  # streaming: the text sent so far

    def _stream_reply(self, output: RequestOutput) -> Reply:
        if output.finished:
            return Reply(self._full_outputs(output), final=True)
        delta = self.detok.add(output.new_token_ids)
        if not delta:  # an incomplete character: wait for the tokens that complete it
            return Reply(None, final=False)
        self.text += delta
        return Reply(self._outputs(self.text, None, None), final=False)

    def _completion(self, finish_reason: str | None) -> tuple[list[int], str | None]:
        """The output tokens text_output shows (without a matched stop string or end token) and the stop
        string that ended the request, if one did."""
        tokens = self.token_ids
        if finish_reason != "stop":
            return tokens, None
        for word, ids in self.request.stop_words:
            if len(tokens) >= len(ids) and tuple(tokens[-len(ids) :]) == ids:
                return tokens[: -len(ids)], word
        if tokens and tokens[-1] in self.request.end_ids:
            return tokens[:-1], None
        return tokens, None

    def _full_outputs(self, output: RequestOutput) -> dict[str, np.ndarray]:
        tokens, stop_reason = self._completion(output.finish_reason)
        if self.request.streaming or self.request.exclude_input_in_output:
            text = decode_all(self.tokenizer, tokens, self.request.prompt_ids, self.skip_special_tokens)
        else:
            ids = self.request.prompt_ids + tokens
            text = str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))
        finish_reason = FINISH_REASONS.get(output.finish_reason or "", output.finish_reason)
        return self._outputs(text, finish_reason, stop_reason)

    def _outputs(
        self, text: str, finish_reason: str | None, stop_reason: str | None
    ) -> dict[str, np.ndarray]:
        outputs = {"text_output": tu.string_array([text], (1,))}
        if self.request.return_finish_reason:
            outputs["finish_reason"] = tu.string_array([str(finish_reason)], (1,))
        if self.request.return_stop_reason:
            outputs["stop_reason"] = tu.string_array([str(stop_reason)], (1,))
        if self.request.return_cumulative_logprob:
            outputs["cumulative_logprob"] = np.array([self.logprob_sum], dtype=np.float32)
        return outputs

    def _perf_outputs(self, output: RequestOutput) -> dict[str, np.ndarray]:
        stats = output.stats
        if stats is None:  # ended before the engine took it: nothing was measured
            return {}
        prompt_blocks = math.ceil(output.num_prompt_tokens / self.tokens_per_block)
        reused = stats.num_blocks_reused
        missed = max(prompt_blocks - reused, 0)
        hit_rate = reused / (reused + missed) if reused + missed else 0.0
        speculative = speculative_outputs(stats.num_draft_tokens, stats.num_accepted_draft_tokens)
        return {
            "kv_cache_reused_block": np.array([reused], dtype=np.int32),
            "kv_cache_missed_block": np.array([missed], dtype=np.int32),
            "kv_cache_alloc_new_blocks": np.array([stats.num_blocks_allocated], dtype=np.int32),
            "kv_cache_alloc_total_blocks": np.array([stats.num_blocks_allocated + reused], dtype=np.int32),
            "kv_cache_hit_rate": np.array([hit_rate], dtype=np.float32),
            "arrival_time_ns": _ns(stats.arrival_time),
            "first_scheduled_time_ns": _ns(stats.first_scheduled_time),
            "first_token_time_ns": _ns(stats.first_token_time),
            "last_token_time_ns": _ns(stats.last_token_time),
            **{name: value.reshape(1) for name, value in speculative.items()},
        }
