"""The `postprocessing` model: TOKENS_BATCH [batch, beam, len] + SEQUENCE_LENGTH [batch, beam] -> OUTPUT, the
texts as a flat [batch * beam] array (tensorrtllm_backend's shape: clients read `text_output[0]`).

Stateless, like tensorrtllm_backend's: each response is decoded on its own. That is exact for a whole
output and for streamed chunks that end on a character boundary, which the torch `tensorrt_llm` model
guarantees for byte-level BPE tokenizers; the BLS model is exact for every tokenizer (it keeps state).

It is also where a cancelled ensemble stream is stopped. Triton's ensemble scheduler never tells the running
`tensorrt_llm` step that its client went away; it marks as cancelled only the steps it schedules after the
cancellation (triton-inference-server/core:src/ensemble_scheduler/ensemble_scheduler.cc@73aad7c, ScheduleSteps),
and every streamed chunk schedules a `postprocessing` step. With the torch engine the ensemble passes each
chunk's ENGINE_REQUEST_ID here, and a cancelled step sends the engine tensorrtllm_backend's `stop` request
under that id: the sequence ends, and its KV blocks are freed, a chunk after the client left.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.io import ENGINE_REQUEST_ID_INPUT, InvalidInputError, stop_request_inputs
from pipeline.serving.triton_models.tokenization import load_tokenizer

# Streams whose next check time is remembered; a stream pushed out (more than this many at once) is only
# asked again sooner.
_TRACKED_STREAMS = 1024
# Finished stop calls' response iterators, kept referenced this long: Triton 2.51's stub frees a finished
# iterator's responses without the GIL when its cleanup thread drops the last reference (bls.py, _BLS_TURNS).
_RETIRED_KEEP_S = 3.0


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
        self.engine_model = params.string("tensorrt_llm_model_name", "tensorrt_llm")
        # is_cancelled() is an IPC round trip to tritonserver: a stream asks it at most this often, not per chunk
        self.cancel_check_period_s = params.integer("cancellation_check_period_ms", 100, minimum=0) / 1000.0
        self._next_check: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._retired: collections.deque[tuple[float, Any]] = collections.deque()

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            inputs = tu.request_inputs(request, ("TOKENS_BATCH", "SEQUENCE_LENGTH", ENGINE_REQUEST_ID_INPUT))
            if ENGINE_REQUEST_ID_INPUT in inputs:
                self._stop_if_cancelled(request, inputs[ENGINE_REQUEST_ID_INPUT].reshape(-1)[0].decode())
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

    def _stop_if_cancelled(self, request: Any, engine_request_id: str) -> None:
        now = time.monotonic()
        if now < self._next_check.get(engine_request_id, 0.0):
            return
        cancelled = request.is_cancelled()
        # a stopped stream's last chunks need no more checks
        self._next_check[engine_request_id] = float("inf") if cancelled else now + self.cancel_check_period_s
        self._next_check.move_to_end(engine_request_id)
        if len(self._next_check) > _TRACKED_STREAMS:
            self._next_check.popitem(last=False)
        if not cancelled:
            return
        stop = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=[pb_utils.Tensor(name, value) for name, value in stop_request_inputs().items()],
            request_id=engine_request_id,
            requested_output_names=["sequence_length"],
        )
        responses = stop.exec(decoupled=True)
        for response in responses:
            if response.has_error():
                tu.log_error(
                    f"could not stop cancelled stream {engine_request_id}: {response.error().message()}"
                )
        self._retired.append((now, responses))
        with contextlib.suppress(IndexError):
            while now - self._retired[0][0] > _RETIRED_KEEP_S:
                self._retired.popleft()

    def finalize(self) -> None:
        self._retired.clear()
        self.tokenizer = None
