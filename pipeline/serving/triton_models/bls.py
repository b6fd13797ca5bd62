"""The `tensorrt_llm_bls` model: the ensemble's inputs and outputs, in one Python model that tokenizes,
calls `tensorrt_llm` through BLS, and detokenizes incrementally, so streamed text is exact for every
tokenizer (multi-byte characters, SentencePiece spaces) and concatenated deltas equal the whole text.

Each request row is served by its own thread (`execute` returns at once), so requests stream concurrently
even with one BLS instance; a request of several rows is several sequences, each answered with its
batch_index (bls_replies). A client that cancels gets its engine requests stopped with `stop=true`. The
`ensemble` model runs this code too (serving.ensemble=bls), with the ensemble's tensors. A response carries
only the outputs its request asked for (all of its model's, when a client names none).

With a draft model (`tensorrt_llm_draft_model_name`, TensorRT-LLM's draft-target flow) a request with
num_draft_tokens > 0 (the input, else the `num_draft_tokens` parameter) runs draft_target's loop instead;
its rounds' tokens stream as they come, and a cancelled client ends it between rounds.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.triton_models import draft_target
from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.bls_replies import RequestReplies, RowReplies
from pipeline.serving.triton_models.bls_text import TextAssembler
from pipeline.serving.triton_models.bls_turns import BlsTurns
from pipeline.serving.triton_models.io import (
    BLS_INPUTS,
    LOG_PROB_OUTPUTS,
    SPEC_OUTPUTS,
    InvalidInputError,
    check_no_parameters,
    scalar,
    speculative_outputs,
    split_rows,
    word_list_to_sequences,
)
from pipeline.serving.triton_models.preprocessing import preprocess
from pipeline.serving.triton_models.tokenization import PromptEncoder

CANCEL_CHECK_PERIOD_S = 0.05
# Two bugs of the Python-backend stub of Triton 2.51 (python_backend r24.10) hit decoupled BLS calls made
# from several threads at once, as this model does (one thread per request):
# - A decoupled exec beside a waking ResponseIterator.__next__ deadlocks the stub (bls_turns says how), and
#   every BLS and ensemble request hangs. Hence _BLS_TURNS: an exec runs while no thread waits in next(),
#   and next() waits run side by side.
# - The stub's cleanup thread erases a finished iterator from its map without the GIL; when that drops the
#   last reference, the responses' numpy arrays are freed without the GIL and the stub dies (SIGSEGV in
#   libpython's _PyObject_Malloc). Hence finished iterators are kept referenced here for _RETIRED_KEEP_S, so
#   Python, with the GIL, drops the last reference. (python_backend fixed this later: #390, Dec 2024.) The
#   stub queues that erase when the iteration ends and its utility thread gets to it within milliseconds,
#   so 3 s is ample; longer costs memory, since a kept iterator holds every response of its call (kept 10 s,
#   they came to ~60 MB of the stub and ~30 MB of tritonserver under a soak of ~20 requests/s).
_BLS_TURNS = BlsTurns()
_RETIRED_KEEP_S = 3.0
# What an engine call asks for: the tokens and log-probs, SPEC_OUTPUTS when the client set
# return_perf_metrics, and the logits it asked for (return_context_logits / return_generation_logits).
_TEXT_OUTPUTS = ("output_ids", "sequence_length", *LOG_PROB_OUTPUTS)
# client input -> preprocessing input (tokenized here)
_TO_PREPROCESS = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
    "decoder_text_input": "DECODER_QUERY",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "apply_chat_template": "APPLY_CHAT_TEMPLATE",
}
# preprocessing output -> tensorrt_llm input
_FROM_PREPROCESS = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
    "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list",
    "DECODER_INPUT_ID": "decoder_input_ids",
    "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths",
    "EMBEDDING_BIAS": "embedding_bias",
}
# client input -> tensorrt_llm input, passed as sent
_PASS_THROUGH = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_tokens",
    "seed": "seed",
    "return_log_probs": "return_log_probs",
    "stream": "streaming",
    "exclude_input_in_output": "exclude_input_in_output",
    "return_perf_metrics": "return_perf_metrics",
    "min_length": "min_length",
    "random_seed": "random_seed",
    "beam_width": "beam_width",
    "num_return_sequences": "num_return_sequences",
    "length_penalty": "len_penalty",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_kv_cache_reuse_stats": "return_kv_cache_reuse_stats",
}


@dataclass(frozen=True)
class BlsPlan:
    engine_inputs: dict[str, np.ndarray]  # tensorrt_llm tensors, batch dimension 1
    prompt_ids: list[int]
    streaming: bool
    exclude_input_in_output: bool
    num_draft_tokens: int | None = None  # the client's num_draft_tokens, when sent
    return_perf_metrics: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False

    def engine_outputs(self) -> tuple[str, ...]:
        """The tensorrt_llm outputs this request needs."""
        wanted = {
            SPEC_OUTPUTS: self.return_perf_metrics,
            ("context_logits",): self.return_context_logits,
            ("generation_logits",): self.return_generation_logits,
        }
        return sum((names for names, on in wanted.items() if on), _TEXT_OUTPUTS)


def _flag(inputs: dict[str, np.ndarray], name: str, default: bool) -> bool:
    value = inputs.get(name)
    return default if value is None else bool(np.asarray(value).reshape(-1)[0])


def plan_request(
    encoder: PromptEncoder,
    inputs: dict[str, np.ndarray],
    max_seq_len: int | None,
    default_exclude_input: bool,
) -> BlsPlan:
    """One row's client tensors (batch dimension 1) -> the tensorrt_llm request. Raises InvalidInputError."""
    text, ids = inputs.get("text_input"), inputs.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidInputError(
            "text_input", None, "send the prompt as text_input or as token ids in input_ids, one of them"
        )
    pre_inputs = {_TO_PREPROCESS[k]: v for k, v in inputs.items() if k in _TO_PREPROCESS}
    if ids is not None:
        # Preprocessing derives the other tensors (stop words, end id) from a text row; the ids then
        # replace that row's encoding, and the engine checks them against the vocabulary and the limits.
        pre_inputs["QUERY"] = np.array([[b"input_ids"]], dtype=object)
    pre = preprocess(encoder, pre_inputs, max_seq_len)
    engine_inputs = {_FROM_PREPROCESS[k]: v for k, v in pre.items()}
    engine_inputs.update({_PASS_THROUGH[k]: v for k, v in inputs.items() if k in _PASS_THROUGH})
    if ids is not None:
        prompt = _prompt_ids(ids)
        engine_inputs["input_ids"] = np.array([prompt], dtype=np.int32)
        engine_inputs["input_lengths"] = np.array([[len(prompt)]], dtype=np.int32)
    else:
        prompt = pre["INPUT_ID"][0, : int(pre["REQUEST_INPUT_LEN"][0, 0])].tolist()
    exclude = _flag(inputs, "exclude_input_in_output", default_exclude_input)
    engine_inputs["exclude_input_in_output"] = np.array([[exclude]], dtype=np.bool_)
    num_drafts = scalar(inputs, "num_draft_tokens")
    if num_drafts is not None and num_drafts < 0:
        raise InvalidInputError("num_draft_tokens", num_drafts, "must be >= 0 (0 = no speculation)")
    return BlsPlan(
        engine_inputs,
        prompt,
        _flag(inputs, "stream", False),
        exclude,
        num_draft_tokens=None if num_drafts is None else int(num_drafts),
        return_perf_metrics=_flag(inputs, "return_perf_metrics", False),
        return_log_probs=_flag(inputs, "return_log_probs", False),
        return_context_logits=_flag(inputs, "return_context_logits", False),
        return_generation_logits=_flag(inputs, "return_generation_logits", False),
    )


def _prompt_ids(ids: np.ndarray) -> list[int]:
    if ids.dtype.kind not in "iu":
        raise InvalidInputError("input_ids", ids.dtype.name, "wrong data type (expected INT32 token ids)")
    prompt = [int(t) for t in ids.reshape(-1)]
    if not prompt or min(prompt) < 0:
        raise InvalidInputError("input_ids", prompt[:5], "needs at least one token id, each >= 0")
    return prompt


class EngineCallError(Exception):
    """An engine model answered a BLS call with an error; the client gets its message."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(f"{model}: {message}")
        self.invalid_argument = "input '" in message  # the engine named a bad input: the client's mistake


def _as_numpy(response: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The outputs among `names` (those the request asked for) that the response carries."""
    found = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


class BlsModel:
    """TritonPythonModel for `tensorrt_llm_bls` (pipeline/serving/templates/tensorrt_llm_bls/1/model.py)."""

    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.declared_outputs = frozenset(output["name"] for output in config["output"])
        params = tu.ModelParameters(args["model_name"], config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine_decoupled = params.boolean("decoupled_mode", self.decoupled)
        self.engine_model = params.string("tensorrt_llm_model_name", "tensorrt_llm")
        self.draft_model = params.string("tensorrt_llm_draft_model_name", "")
        self.num_draft_tokens = params.integer("num_draft_tokens", 0, minimum=0)
        if self.num_draft_tokens and not self.draft_model:
            raise tu.ParameterError(
                args["model_name"],
                "num_draft_tokens",
                self.num_draft_tokens,
                "drafts need a draft model: set tensorrt_llm_draft_model_name, or use 0",
            )
        self.skip_special_tokens = params.boolean("skip_special_tokens", True)
        self.exclude_input_in_output = params.boolean("exclude_input_in_output", False)
        self.max_seq_len = params.optional_integer("max_seq_len", minimum=2)
        self.encoder = PromptEncoder.from_dir(
            params.path("tokenizer_dir", tu.version_dir(args)),
            add_special_tokens=params.boolean("add_special_tokens", True),
            max_input_len=params.optional_integer("max_input_len", minimum=1),
        )
        self._retired: collections.deque[tuple[float, Any]] = collections.deque()  # see _BLS_TURNS
        # At most the engine's batch of this model's calls in flight (the BLS's max_batch_size is the engine's
        # unless serving.triton_max_batch_size says otherwise): a call past it would wait in the engine's queue
        # inside next(), and every new call would wait for that one (bls_turns).
        self._engine_slots = threading.BoundedSemaphore(max(1, int(config.get("max_batch_size", 0))))

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            inputs = tu.request_inputs(request, BLS_INPUTS)
            sender = request.get_response_sender()
            try:
                check_no_parameters(request.parameters())
                prompt = "text_input" if "text_input" in inputs else "input_ids"
                rows = split_rows(inputs, decoupled=self.decoupled, prompt=prompt)
            except InvalidInputError as err:
                sender.send(tu.error_response(str(err)), flags=tu.FINAL)
                continue
            replies = RequestReplies(sender, len(rows), tu.requested_outputs(request, self.declared_outputs))
            for index, row in enumerate(rows):
                threading.Thread(
                    target=self._serve, args=(row, replies.row(index)), name="llmpipe-bls", daemon=True
                ).start()
        return None

    def _serve(self, inputs: dict[str, np.ndarray], replies: RowReplies) -> None:
        try:
            plan = plan_request(self.encoder, inputs, self.max_seq_len, self.exclude_input_in_output)
            if plan.streaming and not self.decoupled:
                raise InvalidInputError("stream", True, "this deployment is not decoupled and cannot stream")
            num_drafts = self._num_draft_tokens(plan)
        except InvalidInputError as err:
            replies.fail(str(err))
            return
        try:
            with self._engine_slots:
                if num_drafts:
                    self._generate_draft_target(plan, num_drafts, replies)
                else:
                    self._generate(plan, replies)
        except EngineCallError as err:
            replies.fail(str(err), invalid_argument=err.invalid_argument)
        except Exception as err:  # never let one request take the stub down
            tu.log_error(f"{self.model_name}: request failed: {err!r}")
            replies.fail(f"{self.model_name}: {err}", invalid_argument=False)

    def _num_draft_tokens(self, plan: BlsPlan) -> int:
        wanted = self.num_draft_tokens if plan.num_draft_tokens is None else plan.num_draft_tokens
        if wanted and not self.draft_model:
            raise InvalidInputError(
                "num_draft_tokens",
                wanted,
                "this deployment has no draft model (tensorrt_llm_draft_model_name); a torch engine "
                "speculates by itself when its build config sets speculative.mode",
            )
        return wanted

    def _engine_request(
        self,
        inputs: dict[str, np.ndarray],
        request_id: str,
        model: str = "",
        outputs: Sequence[str] = _TEXT_OUTPUTS,
    ) -> Any:
        tensors = [pb_utils.Tensor(name, value) for name, value in inputs.items()]
        return pb_utils.InferenceRequest(
            model_name=model or self.engine_model,
            inputs=tensors,
            request_id=request_id,
            requested_output_names=list(outputs),
        )

    def _responses(self, request: Any) -> Iterable[Any]:
        if not self.engine_decoupled:
            return [request.exec(decoupled=False)]
        with _BLS_TURNS.call():  # see _BLS_TURNS
            return self._iterate(request.exec(decoupled=True))

    def _iterate(self, responses: Any) -> Iterable[Any]:
        """A decoupled BLS call's responses, each next() in its turn; the iterator is retired after."""
        iterator = iter(responses)
        try:
            while True:
                with _BLS_TURNS.response():
                    try:
                        response = next(iterator)
                    except StopIteration:
                        return
                yield response
        finally:  # no lock here: this may run in the garbage collector; deque operations are atomic
            now = time.monotonic()
            self._retired.append((now, responses))
            with contextlib.suppress(IndexError):
                while now - self._retired[0][0] > _RETIRED_KEEP_S:
                    self._retired.popleft()

    def _generate(self, plan: BlsPlan, replies: RowReplies) -> None:
        request_id = f"bls-{uuid.uuid4().hex}"
        assembler = TextAssembler(self.encoder.tokenizer, plan, self.skip_special_tokens)
        cancelled, next_check = False, 0.0
        outputs = plan.engine_outputs()
        for response in self._responses(
            self._engine_request(plan.engine_inputs, request_id, outputs=outputs)
        ):
            # is_cancelled() is an IPC round trip: ask at most every CANCEL_CHECK_PERIOD_S, not per token.
            if not cancelled and time.monotonic() >= next_check:
                next_check = time.monotonic() + CANCEL_CHECK_PERIOD_S
                if replies.is_cancelled():
                    cancelled = True
                    self._stop_engine(request_id)
            if cancelled:
                continue  # drain: the engine ends the stream with its response to the abort
            if response.has_error():
                raise EngineCallError(self.engine_model, response.error().message())
            engine = _as_numpy(response, outputs)
            if "output_ids" not in engine:
                continue
            delta = assembler.add(engine)
            if delta is not None:
                replies.send(delta)
        replies.finish(None if cancelled else assembler.finish())

    def _call(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One non-streaming engine request; its outputs."""
        found: dict[str, np.ndarray] = {}
        for response in self._responses(self._engine_request(inputs, f"bls-{uuid.uuid4().hex}", model)):
            if response.has_error():
                raise EngineCallError(model, response.error().message())
            found.update(_as_numpy(response, _TEXT_OUTPUTS))
        return found

    def _generate_draft_target(self, plan: BlsPlan, num_draft_tokens: int, replies: RowReplies) -> None:
        engine_inputs = plan.engine_inputs
        end_id = scalar(engine_inputs, "end_id")
        stop_words = engine_inputs.get("stop_words_list")
        request = draft_target.DraftTargetRequest(
            engine_inputs=engine_inputs,
            prompt_ids=plan.prompt_ids,
            max_tokens=int(scalar(engine_inputs, "request_output_len") or 0),
            min_tokens=int(scalar(engine_inputs, "min_tokens") or 0),
            num_draft_tokens=num_draft_tokens,
            end_id=int(end_id) if end_id is not None and end_id >= 0 else None,
            stop_words=word_list_to_sequences(
                "stop_words_list", None if stop_words is None else np.asarray(stop_words)[0]
            ),
        )
        assembler = TextAssembler(self.encoder.tokenizer, plan, self.skip_special_tokens)
        # A non-streaming response without exclude_input_in_output carries the prompt, as the engine's would.
        shown_prompt = [] if plan.streaming or plan.exclude_input_in_output else plan.prompt_ids
        num_drafts = num_accepted = 0
        cum_log_prob = 0.0
        for step in draft_target.rounds(self._call, self.draft_model, self.engine_model, request):
            num_drafts += step.num_draft_tokens
            num_accepted += step.num_accepted_draft_tokens
            log_probs = step.log_probs if step.log_probs is not None else np.zeros(len(step.token_ids))
            cum_log_prob += float(np.sum(log_probs))
            tokens, shown_prompt = shown_prompt + step.token_ids, []
            delta = assembler.add(
                {
                    "output_ids": np.array(tokens, dtype=np.int32),
                    "sequence_length": np.array([[len(tokens)]], dtype=np.int32),
                    "cum_log_probs": np.array([[cum_log_prob]], dtype=np.float32),
                    "output_log_probs": np.asarray(log_probs, dtype=np.float32),
                }
            )
            if delta is not None:
                replies.send(delta)
            if replies.is_cancelled():  # between rounds: nothing of ours is left running in the engines
                replies.finish()
                return
        assembler.speculative.update(speculative_outputs(num_drafts, num_accepted))
        replies.finish(assembler.finish())

    def _stop_engine(self, request_id: str) -> None:
        """Cancel our engine request: tensorrtllm_backend's `stop` input, with the same request id."""
        stop = {
            "input_ids": np.zeros((1, 1), np.int32),
            "input_lengths": np.ones((1, 1), np.int32),
            "request_output_len": np.ones((1, 1), np.int32),
            "stop": np.ones((1, 1), np.bool_),
        }
        for _ in self._responses(self._engine_request(stop, request_id)):
            pass

    def finalize(self) -> None:
        self._retired.clear()
        self.encoder = None  # type: ignore[assignment]
