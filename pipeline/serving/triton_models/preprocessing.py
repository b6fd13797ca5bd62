"""The `preprocessing` model: text_input, stop/bad words, end/pad ids -> the tensorrt_llm model's tensors.

I/O names and behaviour are tensorrtllm_backend's (QUERY -> INPUT_ID, ...;
all_models/inflight_batcher_llm/preprocessing@86542b6): text_input is tokenized as sent, never through a
chat template unless the request sets APPLY_CHAT_TEMPLATE (llmpipe's input). Each row of a request is
tokenized alone; rows of different lengths are right-padded with the pad id (REQUEST_INPUT_LEN holds the
real lengths). A decoder-only model has no decoder input: DECODER_INPUT_ID is one pad id per row, as
upstream sends when DECODER_QUERY is absent. EMBEDDING_BIAS is upstream's vocabulary-sized bias per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.io import InvalidInputError, check_no_parameters
from pipeline.serving.triton_models.tokenization import PromptEncoder, decode_text, decode_words

INPUTS = (
    "QUERY", "REQUEST_OUTPUT_LEN", "BAD_WORDS_DICT", "STOP_WORDS_DICT", "END_ID", "PAD_ID", "DECODER_QUERY",
    "EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS", "APPLY_CHAT_TEMPLATE",
)  # fmt: skip


def _rows(array: np.ndarray | None, batch: int, name: str) -> list[Any]:
    """Per-row values of an optional input (None rows when absent)."""
    if array is None:
        return [None] * batch
    if array.shape[0] != batch:
        raise InvalidInputError(
            name, f"batch of {array.shape[0]}", f"must match text_input's batch of {batch}"
        )
    return list(array)


def _pad(rows: list[list[int]], value: int) -> np.ndarray:
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), value, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _stack_word_lists(lists: list[np.ndarray]) -> np.ndarray:
    width = max(w.shape[1] for w in lists)
    out = np.zeros((len(lists), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, w in enumerate(lists):
        out[i, :, : w.shape[1]] = w
    return out


def _check_output_len(values: np.ndarray, prompts: list[list[int]], max_seq_len: int | None) -> np.ndarray:
    lengths = np.asarray(values).reshape(len(prompts), -1)
    for prompt, row in zip(prompts, lengths, strict=True):
        wanted = int(row[0])
        if wanted < 1:
            raise InvalidInputError("max_tokens", wanted, "must be >= 1")
        if max_seq_len is not None and len(prompt) + wanted > max_seq_len:
            raise InvalidInputError(
                "max_tokens",
                wanted,
                f"prompt ({len(prompt)} tokens) + max_tokens exceeds the "
                f"engine's max_seq_len={max_seq_len}; ask for at most {max_seq_len - len(prompt)}",
            )
    return lengths.astype(np.int32)


def _embedding_bias(
    encoder: PromptEncoder, words: np.ndarray | None, weights: np.ndarray | None, batch: int
) -> np.ndarray:
    """Per row, a vocabulary-sized bias: each word's weight added at each of its token ids; [batch, 0] when
    the request sends no words."""
    if words is None or weights is None:
        return np.zeros((batch, 0), dtype=np.float32)
    vocab = len(encoder.tokenizer)
    out = np.zeros((batch, vocab), dtype=np.float32)
    for row, (row_words, row_weights) in enumerate(zip(words, weights, strict=True)):
        texts = decode_words("embedding_bias_words", row_words)
        values = np.asarray(row_weights, dtype=np.float32).reshape(-1)
        if len(texts) != values.size:
            raise InvalidInputError(
                "embedding_bias_weights", f"{values.size} weights", f"needs one per word ({len(texts)} words)"
            )
        for text, weight in zip(texts, values, strict=True):
            out[row, list(encoder.encode_word(text))] += weight
    return out


def preprocess(
    encoder: PromptEncoder, inputs: dict[str, np.ndarray], max_seq_len: int | None = None
) -> dict[str, np.ndarray]:
    """One request's tensors (batch first) -> its output tensors. Raises InvalidInputError."""
    query = inputs.get("QUERY")
    if query is None:
        raise InvalidInputError("text_input", None, "required: the prompt text")
    batch = query.shape[0]
    output_len = inputs.get("REQUEST_OUTPUT_LEN")
    if output_len is None:
        raise InvalidInputError("max_tokens", None, "required: how many tokens to generate")
    prompts, stops, bads, end_ids, pad_ids = [], [], [], [], []
    rows = zip(
        list(query),
        _rows(inputs.get("STOP_WORDS_DICT"), batch, "stop_words"),
        _rows(inputs.get("BAD_WORDS_DICT"), batch, "bad_words"),
        _rows(inputs.get("END_ID"), batch, "end_id"),
        _rows(inputs.get("PAD_ID"), batch, "pad_id"),
        _rows(inputs.get("APPLY_CHAT_TEMPLATE"), batch, "apply_chat_template"),
        strict=True,
    )
    for text_row, stop_row, bad_row, end_row, pad_row, chat_row in rows:
        text = decode_text("text_input", np.asarray(text_row).reshape(-1)[0])
        chat = chat_row is not None and bool(np.asarray(chat_row).reshape(-1)[0])
        prompts.append(encoder.encode_prompt(text, chat=chat))
        client_end = None if end_row is None else int(np.asarray(end_row).reshape(-1)[0])
        stops.append(
            encoder.word_list(
                decode_words("stop_words", stop_row), encoder.default_stop_sequences(client_end)
            )
        )
        bads.append(encoder.word_list(decode_words("bad_words", bad_row)))
        end_ids.append(encoder.end_id if client_end is None else client_end)
        pad_ids.append(encoder.pad_id if pad_row is None else int(np.asarray(pad_row).reshape(-1)[0]))
    return {
        "INPUT_ID": _pad(prompts, encoder.pad_id),
        "REQUEST_INPUT_LEN": np.array([[len(p)] for p in prompts], dtype=np.int32),
        "BAD_WORDS_IDS": _stack_word_lists(bads),
        "STOP_WORDS_IDS": _stack_word_lists(stops),
        "REQUEST_OUTPUT_LEN": _check_output_len(output_len, prompts, max_seq_len),
        "OUT_END_ID": np.array(end_ids, dtype=np.int32).reshape(batch, 1),
        "OUT_PAD_ID": np.array(pad_ids, dtype=np.int32).reshape(batch, 1),
        "DECODER_INPUT_ID": np.array(pad_ids, dtype=np.int32).reshape(batch, 1),
        "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), dtype=np.int32),
        "EMBEDDING_BIAS": _embedding_bias(
            encoder, inputs.get("EMBEDDING_BIAS_WORDS"), inputs.get("EMBEDDING_BIAS_WEIGHTS"), batch
        ),
    }


class PreprocessingModel:
    """TritonPythonModel for `preprocessing` (pipeline/serving/templates/preprocessing/1/model.py)."""

    def initialize(self, args: dict[str, Any]) -> None:
        import json

        config = json.loads(args["model_config"])
        params = tu.ModelParameters(args["model_name"], config)
        self.encoder = PromptEncoder.from_dir(
            params.path("tokenizer_dir", tu.version_dir(args)),
            add_special_tokens=params.boolean("add_special_tokens", True),
            max_input_len=params.optional_integer("max_input_len", minimum=1),
        )
        self.max_seq_len = params.optional_integer("max_seq_len", minimum=2)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                check_no_parameters(request.parameters())  # the ensemble's first step: the client's keys
                outputs = preprocess(self.encoder, tu.request_inputs(request, INPUTS), self.max_seq_len)
                responses.append(tu.make_response(outputs))
            except InvalidInputError as err:
                responses.append(tu.error_response(str(err)))
        return responses

    def finalize(self) -> None:
        self.encoder = None  # type: ignore[assignment]
