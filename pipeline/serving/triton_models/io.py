"""The `tensorrt_llm` model's tensors <-> (prompt ids, SamplingParams) and back. Pure: numpy in, numpy out.

Tensor names, types and meanings are tensorrtllm_backend's (triton-inference-server/tensorrtllm_backend:
all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt@86542b6, tag v0.18.0, plus the names later
releases gave some of them: min_tokens, seed, return_perf_metrics), so a client written for TensorRT-LLM
works unchanged against the torch engine. Every input arrives with Triton's batch dimension first; a
request of several rows is several sequences (`split_rows`), answered one response stream per row with
`batch_index`, as tensorrtllm_backend does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.runtime.core.sampling_params import SamplingParams

Inputs = Mapping[str, np.ndarray]

# name -> numpy dtype kind Triton delivers ("i" signed, "u" unsigned, "f" float, "b" bool)
ENGINE_INPUTS: dict[str, str] = {
    "input_ids": "i", "input_lengths": "i", "request_output_len": "i", "end_id": "i", "pad_id": "i",
    "stop_words_list": "i", "bad_words_list": "i", "runtime_top_k": "i", "runtime_top_p": "f",
    "temperature": "f", "repetition_penalty": "f", "presence_penalty": "f", "frequency_penalty": "f",
    "min_tokens": "i", "seed": "u", "return_log_probs": "b", "streaming": "b", "stop": "b",
    "exclude_input_in_output": "b", "return_perf_metrics": "b",
    "draft_input_ids": "i", "draft_logits": "f", "draft_acceptance_threshold": "f",
    # tensorrtllm_backend v0.18's names and inputs: honoured at their default, refused beyond what the
    # torch engine does (UNSUPPORTED_AT_DEFAULT says what each may be).
    "min_length": "i", "random_seed": "u", "beam_width": "i", "num_return_sequences": "i",
    "len_penalty": "f", "early_stopping": "b", "return_context_logits": "b", "return_generation_logits": "b",
    "return_kv_cache_reuse_stats": "b", "embedding_bias": "f", "decoder_input_ids": "i",
    "decoder_input_lengths": "i",
}  # fmt: skip
# Inputs the torch engine honours only at upstream's default: (allowed value, why anything else is refused).
UNSUPPORTED_AT_DEFAULT: dict[str, tuple[object, str]] = {
    "beam_width": (1, "the torch engine has no beam search: send 1"),
    "num_return_sequences": (1, "the torch engine returns one sequence per request: send 1"),
    "return_kv_cache_reuse_stats": (
        False,
        "the torch engine does not report per-request KV reuse: send false",
    ),
}
# Upstream's older name -> the name the torch engine reads (both are accepted; sending both must agree).
ALIASES = {"min_length": "min_tokens", "random_seed": "seed"}
# External draft tokens (TensorRT-LLM's draft-target flow, fed by the BLS): the torch engine drafts for
# itself, so it refuses these rather than silently decoding without them.
DRAFT_INPUTS = ("draft_input_ids", "draft_logits", "draft_acceptance_threshold")
# TensorRT-LLM's per-request speculative-decoding outputs, sent with the final response when the request
# sets return_perf_metrics (as tensorrtllm_backend does).
SPEC_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
UPSTREAM_OUTPUTS = (
    "context_logits", "generation_logits", "batch_index", "sequence_index",
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
)  # fmt: skip
# output_ids first: tensorrtllm_backend's benchmark client reads the first output's shape as [1, beam, len].
ENGINE_OUTPUTS = ("output_ids", "sequence_length", *LOG_PROB_OUTPUTS, *SPEC_OUTPUTS, *UPSTREAM_OUTPUTS)
# The ensemble's and the BLS's tensors (tensorrtllm_backend's names), what clients send and receive.
CLIENT_INPUTS = (
    "text_input", "max_tokens", "bad_words", "stop_words", "end_id", "pad_id", "top_k", "top_p", "temperature",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "seed", "return_log_probs",
    "stream", "exclude_input_in_output", "return_perf_metrics",
    "decoder_text_input", "num_return_sequences", "length_penalty", "min_length", "random_seed",
    "return_context_logits", "return_generation_logits", "return_kv_cache_reuse_stats", "beam_width",
    "embedding_bias_words", "embedding_bias_weights",
    "apply_chat_template",  # llmpipe's: format text_input with the tokenizer's chat template
)  # fmt: skip
# The BLS also takes the draft length of its draft-target loop (tensorrtllm_backend's BLS input) and, as
# llmpipe's extension, the prompt as token ids (`input_ids`, tensorrt_llm's name) instead of text_input.
BLS_INPUTS = (*CLIENT_INPUTS, "num_draft_tokens", "input_ids")
CLIENT_OUTPUTS = ("text_output", *LOG_PROB_OUTPUTS, *SPEC_OUTPUTS, *UPSTREAM_OUTPUTS)
# llmpipe's extension: with return_log_probs the BLS also says which tokens those are (`output_ids`).
BLS_OUTPUTS = (*CLIENT_OUTPUTS, "output_ids")
SAMPLING_INPUTS = ("runtime_top_k", "runtime_top_p", "temperature")


class InvalidInputError(ValueError):
    """A request input is wrong; the message names the input, its value and the limit."""

    def __init__(self, name: str, value: object, limit: str) -> None:
        if value is None:
            message = f"input '{name}' is missing: {limit}"
        else:
            shown = value if isinstance(value, str) and len(value) < 80 else _short(value)
            message = f"input '{name}'={shown}: {limit}"
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class RequestLimits:
    """What the engine was built for; requests beyond these fail before they are queued."""

    max_input_len: int
    max_seq_len: int
    vocab_size: int


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input_in_output: bool
    return_perf_metrics: bool = False  # add SPEC_OUTPUTS to the final response


@dataclass(frozen=True)
class StopRequest:
    """`stop=true`: cancel the in-flight request that carries the same Triton request id."""


def _short(value: object) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _array(inputs: Inputs, name: str) -> np.ndarray | None:
    value = inputs.get(name)
    if value is None:
        return None
    array = np.asarray(value)
    kind = ENGINE_INPUTS.get(name)
    allowed = {"i": "iu", "u": "iu", "f": "fiu", "b": "b"}.get(kind or "", array.dtype.kind)
    if array.dtype.kind not in allowed:
        raise InvalidInputError(
            name, array.dtype.name, f"wrong data type (expected {_TYPE_NAMES[kind or 'i']})"
        )
    if array.ndim == 0 or array.shape[0] != 1:
        batch = array.shape[0] if array.ndim else 0
        raise InvalidInputError(name, f"batch of {batch}", "must match the request's other inputs' batch")
    return array[0]


def split_rows(inputs: Inputs, *, decoupled: bool, prompt: str = "input_ids") -> list[dict[str, np.ndarray]]:
    """A request's tensors, one dict per row (batch dimension 1 each); `prompt` names the input whose batch
    the others must match. Rows are separate sequences; like tensorrtllm_backend, more than one needs a
    decoupled deployment (one response stream per row)."""
    batches = {name: np.asarray(v).shape[0] for name, v in inputs.items() if np.asarray(v).ndim}
    batch = batches.get(prompt, max(batches.values(), default=1))
    for name, size in sorted(batches.items()):
        if size != batch:
            raise InvalidInputError(name, f"batch of {size}", f"must match {prompt}'s batch of {batch}")
    if batch > 1 and not decoupled:
        raise InvalidInputError(
            prompt,
            f"batch of {batch}",
            "more than one sequence per request needs a decoupled deployment (serving.decoupled=true); "
            "or send one request per sequence",
        )
    return [{name: np.asarray(v)[row : row + 1] for name, v in inputs.items()} for row in range(batch)]


_TYPE_NAMES = {"i": "INT32", "u": "UINT64", "f": "FP32", "b": "BOOL"}


def flag(inputs: Inputs, name: str, default: bool = False) -> bool:
    """A BOOL `dims: [1]` input, or `default` when the client did not send it."""
    value = scalar(inputs, name)
    return default if value is None else bool(value)


def scalar(inputs: Inputs, name: str) -> float | int | bool | None:
    """The single value of a `dims: [1]` input, or None when the client did not send it."""
    array = _array(inputs, name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidInputError(name, array, f"expected one value, got {array.size}")
    value = array.reshape(-1)[0].item()
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInputError(name, value, "must be a finite number")
    return value


def word_list_to_sequences(
    name: str, array: np.ndarray | None, vocab_size: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """tensorrtllm_backend's `[2, L]` word list (row 0: ids of all words; row 1: end offsets, -1 padded);
    with `vocab_size`, every id must be a token of the model."""
    if array is None:
        return ()
    if array.ndim != 2 or array.shape[0] != 2:
        raise InvalidInputError(
            name, f"shape {list(array.shape)}", "expected [2, L] (ids row, end-offsets row)"
        )
    ids, offsets = array[0].tolist(), array[1].tolist()
    words: list[tuple[int, ...]] = []
    start = 0
    for end in offsets:
        if end < 0:
            break
        if end <= start or end > len(ids):
            raise InvalidInputError(name, offsets, "end offsets must increase and stay within the ids row")
        words.append(tuple(int(t) for t in ids[start:end]))
        start = end
    bad = [t for word in words for t in word if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the model's vocab_size)"
        raise InvalidInputError(name, bad[:5], f"token ids must be {limit}")
    return tuple(words)


def sequences_to_word_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """The inverse of word_list_to_sequences: `[2, max(1, total ids)]` int32; no words -> [[0], [-1]]."""
    ids = [int(t) for word in words for t in word]
    offsets = list(np.cumsum([len(w) for w in words], dtype=np.int64)) if words else []
    width = max(1, len(ids))
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(ids)] = ids
    out[1, : len(offsets)] = offsets
    return out


def check_no_parameters(parameters: str) -> None:
    """Refuse request parameters (`request.parameters()`, a JSON object). Triton's generate endpoint passes
    every JSON field that is not an input of the model as one (the ensemble hands them to each step), so a
    misspelled or unsupported key would otherwise be ignored; no model here reads any. Triton reserves the
    `triton_` prefix for its own keys, which pass."""
    unknown = {k: v for k, v in json.loads(parameters or "{}").items() if not k.startswith("triton_")}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidInputError(
            name,
            unknown[name],
            "unknown key: no input of this model has that name (GET /v2/models/<model>/config lists them)",
        )


def _check_range(name: str, value: float | int, ok: bool, limit: str) -> None:
    if not ok:
        raise InvalidInputError(name, value, limit)


def check_output_len(name: str, max_tokens: float | int, prompt_len: int, limits: RequestLimits) -> None:
    """`name` (the interface's output-length input) is at least 1 and fits max_seq_len with the prompt."""
    _check_range(name, max_tokens, max_tokens >= 1, "must be >= 1")
    _check_range(
        name,
        max_tokens,
        prompt_len + max_tokens <= limits.max_seq_len,
        f"prompt ({prompt_len} tokens) + {name} exceeds the engine's max_seq_len={limits.max_seq_len}; "
        f"ask for at most {limits.max_seq_len - prompt_len}",
    )


def check_streamable(streaming: bool, decoupled: bool, instead: str) -> None:
    """A stream needs a decoupled deployment; `instead`: how the client turns streaming off."""
    if streaming and not decoupled:
        raise InvalidInputError(
            "streaming",
            True,
            f"this deployment is not decoupled and cannot stream: send {instead}, or package with "
            "serving.decoupled=true",
        )


def _sampling(inputs: Inputs) -> tuple[float, int, float]:
    """TensorRT-LLM's convention: no top_k/top_p/temperature -> greedy; top_k=0 and top_p=0 -> greedy."""
    top_k, top_p, temperature = (scalar(inputs, n) for n in SAMPLING_INPUTS)
    if top_k is not None:
        _check_range("runtime_top_k", top_k, top_k >= 0, "must be >= 0 (0 = no top-k limit)")
    if top_p is not None:
        _check_range("runtime_top_p", top_p, 0 <= top_p <= 1, "must be in [0, 1] (0 = no nucleus limit)")
    if temperature is not None:
        _check_range("temperature", temperature, temperature >= 0, "must be >= 0 (0 = greedy)")
    if not top_k and not top_p:
        return 0.0, 0, 1.0  # (temperature, top_k, top_p)
    return 1.0 if temperature is None else float(temperature), int(top_k or 0), float(top_p) if top_p else 1.0


def _penalties(inputs: Inputs) -> tuple[float, float, float]:
    """(repetition, presence, frequency) penalties; absent ones are neutral."""
    repetition = scalar(inputs, "repetition_penalty")
    if repetition is not None:
        _check_range("repetition_penalty", repetition, repetition > 0, "must be > 0 (1 = no penalty)")
    presence, frequency = (scalar(inputs, name) for name in ("presence_penalty", "frequency_penalty"))
    return (1.0 if repetition is None else float(repetition), float(presence or 0.0), float(frequency or 0.0))


def _prompt(inputs: Inputs, limits: RequestLimits) -> list[int]:
    ids = _array(inputs, "input_ids")
    if ids is None:
        raise InvalidInputError("input_ids", None, "required: the prompt's token ids")
    ids = ids.reshape(-1)
    length = scalar(inputs, "input_lengths")
    num_ids = int(ids.size if length is None else length)
    _check_range(
        "input_lengths",
        num_ids,
        1 <= num_ids <= ids.size,
        f"must be between 1 and the {ids.size} ids sent in input_ids",
    )
    _check_range(
        "input_lengths",
        num_ids,
        num_ids <= limits.max_input_len,
        f"prompt is longer than the engine's max_input_len={limits.max_input_len}",
    )
    prompt = [int(t) for t in ids[:num_ids]]
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidInputError("input_ids", bad[:5], f"token ids must be in [0, {limits.vocab_size})")
    return prompt


def parse_engine_request(
    inputs: Inputs, limits: RequestLimits, *, default_exclude_input: bool, decoupled: bool
) -> EngineRequest | StopRequest:
    """Validate a `tensorrt_llm` request; raises InvalidInputError naming the input, value and limit."""
    if scalar(inputs, "stop"):
        return StopRequest()
    _refuse_external_drafts(inputs)
    prompt = _prompt(inputs, limits)
    max_tokens = scalar(inputs, "request_output_len")
    if max_tokens is None:
        raise InvalidInputError("request_output_len", None, "required: how many tokens to generate")
    check_output_len("request_output_len", max_tokens, len(prompt), limits)
    _refuse_beyond_default(inputs)
    min_tokens = _aliased(inputs, "min_length") or 0
    _check_range("min_tokens", min_tokens, 0 <= min_tokens <= max_tokens, f"must be in [0, {max_tokens}]")
    end_id = scalar(inputs, "end_id")
    if end_id is not None:
        _check_range(
            "end_id", end_id, -1 <= end_id < limits.vocab_size, f"must be in [-1, {limits.vocab_size})"
        )
    pad_id = scalar(inputs, "pad_id")
    if pad_id is not None:
        _check_range(
            "pad_id", pad_id, -1 <= pad_id < limits.vocab_size, f"must be in [-1, {limits.vocab_size})"
        )
    seed = _aliased(inputs, "random_seed")
    if seed is not None:
        _check_range("seed", seed, seed >= 0, "must be >= 0")
    streaming = flag(inputs, "streaming")
    check_streamable(streaming, decoupled, "stream=false")
    exclude = scalar(inputs, "exclude_input_in_output")
    temperature, top_k, top_p = _sampling(inputs)
    repetition, presence, frequency = _penalties(inputs)
    try:
        params = SamplingParams(
            max_tokens=int(max_tokens),
            min_tokens=int(min_tokens),
            end_id=None if end_id is None or end_id < 0 else int(end_id),
            stop_token_ids=word_list_to_sequences(
                "stop_words_list", _array(inputs, "stop_words_list"), limits.vocab_size
            ),
            bad_token_ids=word_list_to_sequences(
                "bad_words_list", _array(inputs, "bad_words_list"), limits.vocab_size
            ),
            seed=None if seed is None else int(seed),
            logprobs=flag(inputs, "return_log_probs"),
            context_logits=flag(inputs, "return_context_logits"),
            generation_logits=flag(inputs, "return_generation_logits"),
            logit_bias=_logit_bias(inputs, limits),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
    except ValueError as err:  # a combination SamplingParams rejects; its message names the field
        if isinstance(err, InvalidInputError):
            raise
        raise InvalidInputError("sampling", "(combination)", str(err)) from None
    return EngineRequest(
        prompt,
        params,
        streaming,
        default_exclude_input if exclude is None else bool(exclude),
        return_perf_metrics=bool(scalar(inputs, "return_perf_metrics") or False),
    )


def _aliased(inputs: Inputs, old_name: str) -> float | int | bool | None:
    """The value of an input that upstream renamed, sent under either name."""
    new_name = ALIASES[old_name]
    old, new = scalar(inputs, old_name), scalar(inputs, new_name)
    if old is not None and new is not None and old != new:
        raise InvalidInputError(old_name, old, f"disagrees with {new_name}={new}: send one of them")
    return new if new is not None else old


def _logit_bias(inputs: Inputs, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    """embedding_bias, one value per vocabulary id (or none), as the sparse (id, value) pairs it holds."""
    bias = _array(inputs, "embedding_bias")
    if bias is None or bias.size == 0:
        return ()
    bias = bias.reshape(-1)
    if bias.size != limits.vocab_size:
        raise InvalidInputError(
            "embedding_bias", f"{bias.size} values", f"needs one per vocabulary id ({limits.vocab_size})"
        )
    if not np.all(np.isfinite(bias)):
        raise InvalidInputError("embedding_bias", "(non-finite)", "values must be finite")
    return tuple((int(i), float(bias[i])) for i in np.flatnonzero(bias))


def _refuse_beyond_default(inputs: Inputs) -> None:
    for name, (default, why) in UNSUPPORTED_AT_DEFAULT.items():
        value = scalar(inputs, name)
        if value is not None and value != default:
            raise InvalidInputError(name, value, why)


def _refuse_external_drafts(inputs: Inputs) -> None:
    """An empty draft_input_ids means "no drafts" and passes; anything else is TensorRT-LLM's flow."""
    for name in DRAFT_INPUTS:
        array = _array(inputs, name)
        if array is not None and (name != "draft_input_ids" or array.size):
            raise InvalidInputError(
                name,
                array,
                "the torch engine drafts its own tokens (build with speculative.mode ngram or draft_model); "
                "external draft tokens are TensorRT-LLM's draft-target flow (backend trtllm)",
            )


def speculative_outputs(num_draft_tokens: int, num_accepted_draft_tokens: int) -> dict[str, np.ndarray]:
    """SPEC_OUTPUTS, `[batch=1, 1]` each; acceptance_rate is 0 when nothing was drafted."""
    rate = num_accepted_draft_tokens / num_draft_tokens if num_draft_tokens else 0.0
    return {
        "acceptance_rate": np.array([[rate]], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([[num_accepted_draft_tokens]], dtype=np.int32),
        "total_draft_tokens": np.array([[num_draft_tokens]], dtype=np.int32),
    }


def engine_outputs(
    token_ids: Sequence[int],
    logprobs: Sequence[float] | None,
    cum_log_prob: float,
    context_logits: np.ndarray | None = None,
    generation_logits: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """One response's tensors: `[batch=1, beam=1, ...]` like tensorrtllm_backend's; the log-prob and
    logits outputs only when the request asked for them (not None). `context_logits` [prompt, vocab],
    `generation_logits` [tokens, vocab]."""
    count = len(token_ids)
    outputs: dict[str, np.ndarray] = {
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, 1, count),
        "sequence_length": np.array([[count]], dtype=np.int32),
    }
    if logprobs is not None:
        outputs["cum_log_probs"] = np.array([[cum_log_prob]], dtype=np.float32)
        outputs["output_log_probs"] = np.asarray(logprobs, dtype=np.float32).reshape(1, 1, -1)
    if context_logits is not None:
        outputs["context_logits"] = context_logits[None]
    if generation_logits is not None:
        outputs["generation_logits"] = generation_logits[None, None]
    return outputs


def batch_index(row: int) -> dict[str, np.ndarray]:
    """The row of a several-sequence request that a response belongs to (tensorrtllm_backend's output)."""
    return {"batch_index": np.array([[row]], dtype=np.int32)}
