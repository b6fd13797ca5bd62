"""The `postprocessing` model: TOKENS_BATCH [batch, beam, len] + SEQUENCE_LENGTH [batch, beam] -> OUTPUT, the
texts as a flat [batch * beam] array (tensorrtllm_backend's shape: clients read `text_output[0]`).

Stateless, like tensorrtllm_backend's: each response is decoded on its own. That is exact for a whole
output and for streamed chunks that end on a character boundary, which the torch `tensorrt_llm` model
guarantees for byte-level BPE tokenizers; the BLS model is exact for every tokenizer (it keeps state).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.io import InvalidInputError
from pipeline.serving.triton_models.tokenization import load_tokenizer


def postprocess(
    tokenizer: Any, tokens: np.ndarray, lengths: np.ndarray, skip_special_tokens: bool
) -> np.ndarray:
    """Decode each `tokens[b, beam, :lengths[b, beam]]`; returns a flat [batch * beam] STRING array."""
    if tokens.ndim == 2:  # [batch, len]: a single beam
        tokens = tokens[:, None, :]
    lengths = np.asarray(lengths).reshape(tokens.shape[0], -1)
    if lengths.shape[1] != tokens.shape[1]:
        raise InvalidInputError(
            "SEQUENCE_LENGTH",
            f"shape {list(lengths.shape)}",
            f"must be [batch, beam] matching TOKENS_BATCH {list(tokens.shape)}",
        )
    vocab_size = len(tokenizer)
    texts = []
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            count = int(lengths[b, beam])
            if not 0 <= count <= tokens.shape[2]:
                raise InvalidInputError("SEQUENCE_LENGTH", count, f"must be in [0, {tokens.shape[2]}]")
            ids = tokens[b, beam, :count].tolist()
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:  # tokenizers raise OverflowError on a negative id and decode one past the end as ""
                raise InvalidInputError("TOKENS_BATCH", bad[:5], f"token ids must be in [0, {vocab_size})")
            texts.append(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
    return tu.string_array(texts, (tokens.shape[0] * tokens.shape[1],))


class PostprocessingModel:
    """TritonPythonModel for `postprocessing` (pipeline/serving/templates/postprocessing/1/model.py)."""

    def initialize(self, args: dict[str, Any]) -> None:
        params = tu.ModelParameters(args["model_name"], json.loads(args["model_config"]))
        self.tokenizer = load_tokenizer(params.path("tokenizer_dir", tu.version_dir(args)))
        self.skip_special_tokens = params.boolean("skip_special_tokens", True)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            inputs = tu.request_inputs(request, ("TOKENS_BATCH", "SEQUENCE_LENGTH"))
            try:
                text = postprocess(
                    self.tokenizer,
                    inputs["TOKENS_BATCH"],
                    inputs["SEQUENCE_LENGTH"],
                    self.skip_special_tokens,
                )
                responses.append(tu.make_response({"OUTPUT": text}))
            except (InvalidInputError, KeyError) as err:
                responses.append(tu.error_response(f"postprocessing: {err}"))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None
