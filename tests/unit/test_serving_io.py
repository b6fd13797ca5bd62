"""pipeline.serving's pure parts: request parsing and validation, word lists, tokenization, incremental
detokenization, pre/postprocessing and the per-request response logic. Real tokenizer, no server."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests import stub_pb_utils

stub_pb_utils.install()

from pipeline.runtime.core.outputs import RequestOutput  # noqa: E402
from pipeline.serving.triton_models.detokenizer import IncrementalDetokenizer, decode_all  # noqa: E402
from pipeline.serving.triton_models.io import (  # noqa: E402
    EngineRequest,
    InvalidInputError,
    RequestLimits,
    StopRequest,
    engine_outputs,
    parse_engine_request,
    sequences_to_word_list,
    split_rows,
    word_list_to_sequences,
)
from pipeline.serving.triton_models.postprocessing import postprocess  # noqa: E402
from pipeline.serving.triton_models.preprocessing import preprocess  # noqa: E402
from pipeline.serving.triton_models.streams import RequestState  # noqa: E402
from pipeline.serving.triton_models.tokenization import PromptEncoder, decode_text, load_tokenizer  # noqa: E402
from tests.serving_helpers import MULTIBYTE_PROMPT  # noqa: E402

LIMITS = RequestLimits(max_input_len=32, max_seq_len=64, vocab_size=2000)


def _req(**inputs: object) -> dict[str, np.ndarray]:
    base: dict[str, object] = {"input_ids": [[5, 6, 7]], "input_lengths": [3], "request_output_len": [8]}
    base.update(inputs)
    return {k: np.asarray(v) for k, v in base.items()}


def _parse(decoupled: bool = True, **inputs: object) -> EngineRequest:
    parsed = parse_engine_request(_req(**inputs), LIMITS, default_exclude_input=True, decoupled=decoupled)
    assert isinstance(parsed, EngineRequest)
    return parsed


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> object:
    return load_tokenizer(tokenizer_dir)


# --- tensorrt_llm request parsing ---


def test_no_sampling_inputs_means_greedy_and_defaults_apply() -> None:
    parsed = _parse()
    assert parsed.prompt_ids == [5, 6, 7]
    assert parsed.params.greedy and parsed.params.max_tokens == 8
    assert parsed.exclude_input_in_output is True and parsed.streaming is False


def test_sampling_follows_tensorrt_llm_conventions() -> None:
    assert _parse(temperature=[0.7]).params.greedy  # temperature alone: greedy (top_k=top_p=0)
    sampled = _parse(runtime_top_k=[40], temperature=[0.7], seed=np.array([3], np.uint64)).params
    assert not sampled.greedy and sampled.top_k == 40 and sampled.temperature == pytest.approx(0.7)
    assert sampled.seed == 3 and sampled.top_p == 1.0
    assert _parse(runtime_top_p=[0.9]).params.top_p == pytest.approx(0.9)
    assert _parse(runtime_top_k=[1], temperature=[1.0]).params.greedy


def test_input_lengths_slices_padded_ids_and_word_lists_parse() -> None:
    stop = sequences_to_word_list([[9, 10], [11]])
    parsed = _parse(
        input_ids=[[5, 6, 7, 0, 0]],
        input_lengths=[3],
        stop_words_list=stop[None],
        end_id=[2],
        return_log_probs=[True],
        streaming=[True],
    )
    assert parsed.prompt_ids == [5, 6, 7]
    assert parsed.params.stop_token_ids == ((9, 10), (11,)) and parsed.params.end_id == 2
    assert parsed.params.logprobs and parsed.streaming


@pytest.mark.parametrize(
    ("inputs", "name", "fragment"),
    [
        ({"request_output_len": [0]}, "request_output_len", ">= 1"),
        ({"request_output_len": [62]}, "request_output_len", "max_seq_len=64"),
        ({"input_ids": [list(range(40))], "input_lengths": [40]}, "input_lengths", "max_input_len=32"),
        ({"input_ids": [[5, 2001]], "input_lengths": [2]}, "input_ids", "[0, 2000)"),
        ({"input_lengths": [9]}, "input_lengths", "between 1 and the 3 ids"),
        ({"temperature": [-1.0], "runtime_top_k": [5]}, "temperature", ">= 0"),
        ({"runtime_top_p": [1.5]}, "runtime_top_p", "[0, 1]"),
        ({"runtime_top_k": [-2]}, "runtime_top_k", ">= 0"),
        ({"temperature": [float("nan")]}, "temperature", "finite"),
        ({"repetition_penalty": [0.0]}, "repetition_penalty", "> 0"),
        ({"min_tokens": [9]}, "min_tokens", "[0, 8]"),
        ({"end_id": [5000]}, "end_id", "[-1, 2000)"),
        ({"temperature": np.array([1], np.int8).astype(bool)}, "temperature", "wrong data type"),
        ({"stop_words_list": [[[1, 2], [5, -1]]]}, "stop_words_list", "end offsets"),
        ({"streaming": [True]}, "streaming", "not decoupled"),
    ],
)
def test_bad_inputs_name_the_input_value_and_limit(inputs: dict, name: str, fragment: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        parse_engine_request(
            _req(**inputs), LIMITS, default_exclude_input=True, decoupled="streaming" not in inputs
        )
    assert f"input '{name}'" in str(err.value) and fragment in str(err.value)


def test_missing_required_inputs_and_stop_requests() -> None:
    with pytest.raises(InvalidInputError, match="input 'input_ids' is missing"):
        parse_engine_request({}, LIMITS, default_exclude_input=True, decoupled=True)
    stop = parse_engine_request(
        {"stop": np.array([True])}, LIMITS, default_exclude_input=True, decoupled=True
    )
    assert isinstance(stop, StopRequest)


def test_word_list_round_trip_and_empty_list() -> None:
    words = ((1, 2, 3), (4,), (5, 6))
    assert word_list_to_sequences("w", sequences_to_word_list(words)) == words
    empty = sequences_to_word_list([])
    assert empty.tolist() == [[0], [-1]] and word_list_to_sequences("w", empty) == ()


def test_engine_outputs_have_tensorrt_llm_shapes() -> None:
    out = engine_outputs([7, 8, 9], [-0.5, -1.0, -0.25], -1.75)
    assert out["output_ids"].shape == (1, 1, 3) and out["output_ids"].dtype == np.int32
    assert out["sequence_length"].tolist() == [[3]] and out["cum_log_probs"].tolist() == [[-1.75]]
    assert out["output_log_probs"].shape == (1, 1, 3)


def test_log_probs_are_sent_only_when_asked() -> None:
    assert set(engine_outputs([7, 8], None, 0.0)) == {"output_ids", "sequence_length"}


def test_logits_flags_reach_the_sampling_params_and_outputs() -> None:
    parsed = _parse(return_context_logits=[True], return_generation_logits=[True])
    assert parsed.params.context_logits and parsed.params.generation_logits
    context, generation = np.ones((4, 10), np.float32), np.ones((2, 10), np.float32)
    out = engine_outputs([7, 8], None, 0.0, context, generation)
    assert out["context_logits"].shape == (1, 4, 10) and out["generation_logits"].shape == (1, 1, 2, 10)


def test_upstream_v018_inputs_are_honoured_at_their_defaults() -> None:
    # What NVIDIA's clients send: beam_width 1, num_return_sequences 1, false return_* flags, the v0.18
    # names min_length and random_seed, an empty embedding bias, a decoder input.
    parsed = _parse(
        beam_width=[1], num_return_sequences=[1], return_context_logits=[False],
        return_generation_logits=[False], return_kv_cache_reuse_stats=[False], min_length=[4],
        random_seed=[7], len_penalty=[1.0], embedding_bias=np.zeros((1, 0), np.float32),
        decoder_input_ids=[[0]], decoder_input_lengths=[1],
    )  # fmt: skip
    assert (parsed.params.min_tokens, parsed.params.seed) == (4, 7)


@pytest.mark.parametrize(
    ("inputs", "name", "fragment"),
    [
        ({"beam_width": [4]}, "beam_width", "no beam search"),
        ({"num_return_sequences": [2]}, "num_return_sequences", "one sequence"),
        ({"embedding_bias": np.ones((1, 5), np.float32)}, "embedding_bias", "one per vocabulary id (2000)"),
        ({"min_length": [3], "min_tokens": [4]}, "min_length", "disagrees with min_tokens=4"),
    ],
)
def test_more_than_the_torch_engine_does_is_refused_naming_the_input(
    inputs: dict, name: str, fragment: str
) -> None:
    with pytest.raises(InvalidInputError) as err:
        _parse(**inputs)
    assert f"input '{name}'" in str(err.value) and fragment in str(err.value)


def test_embedding_bias_becomes_the_sparse_logit_bias() -> None:
    bias = np.zeros((1, 2000), np.float32)
    bias[0, [7, 42]] = [2.0, -1.5]
    assert _parse(embedding_bias=bias).params.logit_bias == ((7, 2.0), (42, -1.5))


def test_a_request_of_several_rows_is_several_sequences_when_decoupled() -> None:
    inputs = _req(input_ids=[[5, 6, 7], [8, 9, 0]], input_lengths=[[3], [2]], request_output_len=[[4], [4]])
    rows = split_rows(inputs, decoupled=True)
    prompts = [_parse_row(row).prompt_ids for row in rows]
    assert prompts == [[5, 6, 7], [8, 9]]
    with pytest.raises(InvalidInputError, match="input 'input_ids'=batch of 2: .*decoupled deployment"):
        split_rows(inputs, decoupled=False)
    with pytest.raises(
        InvalidInputError, match="input 'request_output_len'=batch of 1: must match input_ids'"
    ):
        split_rows({**inputs, "request_output_len": np.array([[4]])}, decoupled=True)


def _parse_row(row: dict[str, np.ndarray]) -> EngineRequest:
    parsed = parse_engine_request(row, LIMITS, default_exclude_input=False, decoupled=True)
    assert isinstance(parsed, EngineRequest)
    return parsed


# --- tokenization and detokenization ---


def test_prompt_encoder_matches_the_tokenizer_and_reads_end_ids(
    tokenizer_dir: Path, tokenizer: object
) -> None:
    encoder = PromptEncoder.from_dir(tokenizer_dir, max_input_len=16)
    assert encoder.encode_prompt(MULTIBYTE_PROMPT[:5]) == tokenizer.encode(MULTIBYTE_PROMPT[:5])  # type: ignore[attr-defined]
    assert encoder.end_ids == [tokenizer.eos_token_id]  # type: ignore[attr-defined]
    with pytest.raises(InvalidInputError, match="max_input_len=16"):
        encoder.encode_prompt(MULTIBYTE_PROMPT * 3)
    with pytest.raises(InvalidInputError, match="empty"):
        encoder.encode_prompt("")
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        decode_text("text_input", b"ok \xff\xfe")


def test_incremental_detokenizer_equals_whole_decode_for_any_split(tokenizer: object) -> None:
    rng = random.Random(0)
    prompt = tokenizer.encode(MULTIBYTE_PROMPT)  # type: ignore[attr-defined]
    for _ in range(200):
        output = [rng.randrange(2000) for _ in range(rng.randrange(1, 30))]
        detok, pieces, index = IncrementalDetokenizer(tokenizer, prompt), [], 0
        while index < len(output):
            step = rng.randrange(1, 4)
            pieces.append(detok.add(output[index : index + step]))
            index += step
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_detokenizer_holds_back_incomplete_characters(tokenizer: object) -> None:
    ids = tokenizer.encode("日本", add_special_tokens=False)  # type: ignore[attr-defined]
    assert len(ids) > 2  # byte-level pieces of multi-byte characters
    detok = IncrementalDetokenizer(tokenizer)
    texts = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in t for t in texts) and "".join(texts) + detok.flush() == "日本"
    assert decode_all(tokenizer, ids) == "日本"


# --- preprocessing / postprocessing ---


def test_preprocess_builds_tensorrt_llm_inputs(tokenizer_dir: Path, tokenizer: object) -> None:
    encoder = PromptEncoder.from_dir(tokenizer_dir)
    out = preprocess(encoder, {
        "QUERY": np.array([[MULTIBYTE_PROMPT.encode()]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[5]]),
        "STOP_WORDS_DICT": np.array([[b" the", b""]], dtype=object),
    }, max_seq_len=64)  # fmt: skip
    expected = tokenizer.encode(MULTIBYTE_PROMPT)  # type: ignore[attr-defined]
    assert out["INPUT_ID"][0].tolist() == expected and out["REQUEST_INPUT_LEN"].tolist() == [[len(expected)]]
    stop_ids = tokenizer.encode(" the", add_special_tokens=False)  # type: ignore[attr-defined]
    assert word_list_to_sequences("s", out["STOP_WORDS_IDS"][0]) == (tuple(stop_ids),)
    assert word_list_to_sequences("b", out["BAD_WORDS_IDS"][0]) == ()
    assert out["OUT_END_ID"].tolist() == [[tokenizer.eos_token_id]]  # type: ignore[attr-defined]
    # upstream's outputs for a decoder-only model: one pad id as the decoder input, no embedding bias
    assert out["DECODER_INPUT_ID"].tolist() == out["OUT_PAD_ID"].tolist()
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]] and out["EMBEDDING_BIAS"].shape == (1, 0)
    with pytest.raises(InvalidInputError, match="input 'max_tokens'=60: prompt .* max_seq_len=64"):
        preprocess(
            encoder,
            {
                "QUERY": np.array([[MULTIBYTE_PROMPT.encode()]], dtype=object),
                "REQUEST_OUTPUT_LEN": np.array([[60]]),
            },
            max_seq_len=64,
        )


def test_postprocess_decodes_each_sequence_to_its_length(tokenizer: object) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)  # type: ignore[attr-defined]
    tokens = np.array([[ids + [0, 0]]], dtype=np.int32)
    text = postprocess(tokenizer, tokens, np.array([[len(ids)]]), skip_special_tokens=True)
    assert text.shape == (1,) and text[0].decode() == "hello world"  # flat [batch * beam], as upstream


# --- one request's responses ---


def _output(tokens: list[int], finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, [-0.5] * len(tokens), finished, reason, 3, 0)


def test_streaming_chunks_end_on_character_boundaries(tokenizer: object) -> None:
    ids = tokenizer.encode(" 日本語", add_special_tokens=False)  # type: ignore[attr-defined]
    request = EngineRequest([5, 6], _parse(return_log_probs=[True]).params, True, True)
    state = RequestState("r", request, stub_pb_utils.ResponseSender(), tokenizer)
    chunks = []
    for i, token in enumerate(ids):
        reply = state.on_output(_output([token], i == len(ids) - 1, "length" if i == len(ids) - 1 else None))
        if reply.outputs is not None:
            chunks.append(reply.outputs["output_ids"].reshape(-1).tolist())
    assert sum(chunks, []) == ids and len(chunks) < len(ids)
    assert "".join(tokenizer.decode(c) for c in chunks) == " 日本語"  # type: ignore[attr-defined]
    assert reply.final and reply.outputs["cum_log_probs"].item() == pytest.approx(-0.5 * len(ids))


def test_non_streaming_reply_includes_prompt_when_asked() -> None:
    request = EngineRequest([5, 6], _parse().params, False, False)
    state = RequestState("r", request, stub_pb_utils.ResponseSender())
    assert state.on_output(_output([7])).outputs is None
    reply = state.on_output(_output([8], True, "length"))
    assert reply.final and reply.outputs["output_ids"].reshape(-1).tolist() == [5, 6, 7, 8]
    assert "output_log_probs" not in reply.outputs and "cum_log_probs" not in reply.outputs  # not asked


def test_errors_and_timeouts_become_error_replies() -> None:
    request = EngineRequest([5], _parse().params, False, True)
    failed = RequestState("r", request, stub_pb_utils.ResponseSender()).on_output(
        RequestOutput("r", [], [], True, "error", 1, 0, error="boom")
    )
    assert failed.final and failed.error and "boom" in failed.error
    state = RequestState("r", request, stub_pb_utils.ResponseSender(), arrival_time=0.0, timeout_s=1.0)
    assert state.timed_out()  # past its deadline: the engine aborts it
    timed_out = state.on_output(_output([], True, "abort"))
    assert timed_out.error and "timed out after 1s" in timed_out.error
