"""The `tensorrt_llm` model for the torch backend: Triton is the router, the engine thread is the server.

EngineModel is what both Triton interfaces share (serving.interface): TorchEngineModel takes
inflight_batcher_llm's token-id tensors, llmapi_model.LlmApiModel upstream's llmapi text tensors; each only
parses its requests and builds its responses (a RequestState).

`execute` only validates and enqueues: each request goes to the EngineThread, whose outputs land on one
responder thread that sends every response (and updates every metric: see metrics.py for why one
thread). The responder also asks Triton whether clients went away (`response_sender.is_cancelled()`, every
cancellation_check_period_ms: an IPC round trip the engine thread need not wait for) and aborts those
requests; a `stop=true` request aborts the in-flight request that has the same Triton request id; either
way the request's KV blocks are freed within a step or two. The same code serves decoupled (streaming) and
non-decoupled deployments: the latter answers each request with exactly one response through its response
sender.
"""

from __future__ import annotations

import abc
import gc
import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.config.vocab import SCHEDULER_POLICIES, TRITON_ENGINE_PARAMETERS
from pipeline.errors import PipelineError
from pipeline.runtime.core.outputs import RequestOutput
from pipeline.runtime.engine.async_engine import EngineThread, QueueFullError
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.engine_config import TOKENIZER_DIR, load_engine_config
from pipeline.runtime.spec_decode.metrics import spec_decode_stats
from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.io import (
    ENGINE_INPUTS,
    EngineRequest,
    InvalidInputError,
    RequestLimits,
    StopRequest,
    check_no_parameters,
    engine_outputs,
    parse_engine_request,
    split_rows,
)
from pipeline.serving.triton_models.metrics import EngineMetricsExporter
from pipeline.serving.triton_models.streams import RequestState, ResponseGroup

_SHUTDOWN = object()
# The shortest pause of the responder between cancellation checks (cancellation_check_period_ms=0 means
# "as often as possible"; this keeps that from spinning a core).
MIN_CANCEL_CHECK_PERIOD_S = 0.005
UNSENT_STEPS = 4  # engine outputs the responder may have waiting, in steps of max_batch_size requests


@dataclass(frozen=True)
class EngineSettings:
    engine_dir: Path
    engine_args: EngineArgs
    exclude_input_in_output: bool
    max_pending_requests: int
    stats_period_s: float
    request_timeout_s: float | None
    cancellation_check_period_s: float


def engine_settings(
    params: tu.ModelParameters, engine_dir: Path, cancellation_check_period_ms: int
) -> EngineSettings:
    """The model's config.pbtxt parameters (tensorrtllm_backend's names where they exist), validated; the
    engine folder and the cancellation period come from where each interface keeps them."""
    present = params.values
    name = TRITON_ENGINE_PARAMETERS
    if params.integer("max_beam_width", 1) != 1:
        raise tu.ParameterError(
            params.model,
            "max_beam_width",
            present["max_beam_width"],
            "the torch engine has no beam search: use 1",
        )
    policy, chunked, reuse, fraction = (
        name[field]
        for field in (
            "scheduler.policy",
            "scheduler.enable_chunked_context",
            "kv_cache.enable_block_reuse",
            "kv_cache.free_memory_fraction",
        )
    )
    engine_args = EngineArgs(
        policy=params.choice(policy, SCHEDULER_POLICIES) if policy in present else None,  # type: ignore[arg-type]
        enable_chunked_context=params.boolean(chunked) if chunked in present else None,
        enable_block_reuse=params.boolean(reuse) if reuse in present else None,
        stream_interval=params.integer("stream_interval", 1, minimum=1),
        runner=RunnerArgs(
            device=params.choice("device", ("auto", "cpu", "cuda"), "auto"),
            kv_max_tokens=params.optional_integer(name["kv_cache.max_tokens"], minimum=1),
            kv_free_memory_fraction=params.real(fraction, low=0.0, high=1.0) if fraction in present else None,
        ),
    )
    return EngineSettings(
        engine_dir=engine_dir,
        engine_args=engine_args,
        exclude_input_in_output=params.boolean(name["serving.exclude_input_in_output"], False),
        max_pending_requests=params.integer("max_pending_requests", 64, minimum=1),
        stats_period_s=params.integer("stats_check_period_ms", 100, minimum=1) / 1000.0,
        cancellation_check_period_s=cancellation_check_period_ms / 1000.0,
        request_timeout_s=params.real("request_timeout_s", low=0.0)
        if "request_timeout_s" in present
        else None,
    )


def _load_tokenizer(engine_dir: Path) -> Any | None:
    from pipeline.serving.triton_models.tokenization import load_tokenizer

    folder = engine_dir / TOKENIZER_DIR
    return load_tokenizer(folder) if folder.is_dir() else None


class EngineModel(abc.ABC):
    """The engine behind one Triton model: its thread, the responder, cancellation and `stop`. Subclasses
    set model_name and decoupled, call `_start`, and say how a request is parsed (`_parse`) and answered
    (`_new_state`)."""

    model_name: str
    decoupled: bool

    def _start(self, args: dict[str, Any], settings: EngineSettings, engine_dir_source: str) -> LLMEngine:
        """Load the engine of `settings` and start serving it (`args` are initialize's); a load failure names
        `engine_dir_source`, where the engine folder was configured."""
        self.settings = settings
        tu.forward_logs()
        self.output_names = tuple(output["name"] for output in json.loads(args["model_config"])["output"])
        try:
            engine = LLMEngine.from_engine_dir(settings.engine_dir, settings.engine_args)
        except PipelineError as err:
            raise tu.ParameterError(
                self.model_name,
                engine_dir_source,
                str(settings.engine_dir),
                f"{err.message}" + (f" ({err.hint})" if err.hint else ""),
            ) from None
        vocab_size = load_engine_config(settings.engine_dir).model.vocab_size
        self.limits = RequestLimits(engine.config.max_input_len, engine.config.max_seq_len, vocab_size)
        self.metrics = EngineMetricsExporter(
            pb_utils,
            self.model_name,
            str(args["model_version"]),
            engine.config.max_batch_size,
            engine.runner.tokens_per_block,
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._states: dict[str, RequestState] = {}  # engine request id -> state
        self._by_triton_id: dict[str, list[str]] = {}  # client's request id -> its rows' engine ids (`stop`)
        self._triton_ids: dict[str, str] = {}  # the reverse
        # Bounded: a full queue blocks the engine thread in its output callback, so the engine stays within
        # a few steps of what reached the clients. Unbounded, a fast engine (the tiny test model) ran hundreds
        # of tokens ahead of the responder, and a stream its client cancelled ran to its length unseen.
        self._outputs: queue.Queue[Any] = queue.Queue(maxsize=UNSENT_STEPS * engine.config.max_batch_size)
        self.engine = EngineThread(engine, max_pending=self.settings.max_pending_requests)
        self._responder = threading.Thread(target=self._respond_loop, name="llmpipe-responder", daemon=True)
        self._responder.start()
        return engine

    # --- what an interface defines ---

    @abc.abstractmethod
    def _parse(self, request: Any) -> list[EngineRequest] | StopRequest:
        """The request's sequences (one per row), or a `stop`; raises InvalidInputError."""

    @abc.abstractmethod
    def _new_state(
        self, engine_id: str, parsed: EngineRequest, sender: Any, group: ResponseGroup, row: int | None
    ) -> RequestState:
        """What answers one sequence's engine outputs."""

    @abc.abstractmethod
    def _stop_acknowledgement(self) -> dict[str, np.ndarray]:
        """The outputs of the (final, only) response to a `stop` request."""

    # --- Triton's thread ---

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._enqueue(request)
        return None

    def _enqueue(self, request: Any) -> None:
        sender = tu.response_sender(request, self.output_names)
        try:
            parsed = self._parse(request)
        except InvalidInputError as err:
            _send(sender, tu.error_response(str(err)), final=True)
            return
        triton_id = request.request_id()
        if isinstance(parsed, StopRequest):
            if not triton_id:  # tensorrtllm_backend refuses it too: nothing tells which request to stop
                message = "names no request: send it with the request id of the request to cancel"
                _send(sender, tu.error_response(str(InvalidInputError("stop", True, message))), final=True)
                return
            self._stop(triton_id)
            _send(sender, tu.make_response(self._stop_acknowledgement()), final=True)
            return
        group = ResponseGroup(len(parsed))
        for index, row in enumerate(parsed):
            engine_id = f"{triton_id or 'request'}#{next(self._ids)}"
            state = self._new_state(engine_id, row, sender, group, index if len(parsed) > 1 else None)
            self._submit(state, triton_id)

    def _submit(self, state: RequestState, triton_id: str) -> None:
        engine_id, parsed, sender, group = state.engine_id, state.request, state.sender, state.group
        with self._lock:
            self._states[engine_id] = state
            if triton_id:
                self._by_triton_id.setdefault(triton_id, []).append(engine_id)
                self._triton_ids[engine_id] = triton_id
        try:
            self.engine.submit(
                engine_id,
                parsed.prompt_ids,
                parsed.params,
                callback=self._outputs.put,
                is_cancelled=state.timed_out,
            )
        except Exception as err:
            self._forget(engine_id)
            final = group.finish_one()
            if isinstance(err, QueueFullError):
                _send(sender, tu.unavailable_response(f"{err} ({err.hint})"), final=final)
            elif isinstance(err, ValueError | PipelineError):
                _send(
                    sender,
                    tu.error_response(str(err), invalid_argument=isinstance(err, ValueError)),
                    final=final,
                )
            else:
                raise

    def _stop(self, triton_id: str) -> None:
        with self._lock:
            engine_ids = list(self._by_triton_id.get(triton_id, ())) if triton_id else []
        for engine_id in engine_ids:
            self.engine.abort(engine_id)

    def _forget(self, engine_id: str) -> RequestState | None:
        with self._lock:
            state = self._states.pop(engine_id, None)
            triton_id = self._triton_ids.pop(engine_id, None)
            siblings = self._by_triton_id.get(triton_id, []) if triton_id is not None else []
            if engine_id in siblings:
                siblings.remove(engine_id)
                if not siblings:
                    del self._by_triton_id[triton_id]  # type: ignore[arg-type]
        return state

    # --- responder thread: every send and every metric update happens here ---

    def _respond_loop(self) -> None:
        stats_period = self.settings.stats_period_s
        cancel_period = max(self.settings.cancellation_check_period_s, MIN_CANCEL_CHECK_PERIOD_S)
        next_stats = next_cancel_check = time.monotonic()
        while True:
            due = min(next_stats, next_cancel_check) if self._states else next_stats
            try:
                item = self._outputs.get(timeout=max(due - time.monotonic(), 0.0))
            except queue.Empty:
                item = None
            if item is _SHUTDOWN:
                break
            if item is not None:
                self._respond(item)
            now = time.monotonic()
            if now >= next_cancel_check:
                self._abort_cancelled()
                next_cancel_check = now + cancel_period
            if now >= next_stats:
                self.metrics.update_gauges(self.engine.stats())
                next_stats = now + stats_period
        self.metrics.update_gauges(self.engine.stats())

    def _abort_cancelled(self) -> None:
        """Abort the requests whose clients went away. Each question is an IPC round trip to tritonserver,
        so it is asked here and not on the engine thread, whose steps would wait for the answers."""
        with self._lock:
            states = list(self._states.values())
        for state in states:
            try:
                cancelled = state.sender.is_cancelled()
            except Exception as err:  # a request Triton already released: its final response went out
                tu.log_error(f"could not check request {state.engine_id} for cancellation: {err}")
                continue
            if cancelled:
                self.engine.abort(state.engine_id)

    def _respond(self, output: RequestOutput) -> None:
        with self._lock:
            state = self._states.get(output.request_id)
        if state is None:
            return
        reply = state.on_output(output)
        self.metrics.observe(reply.ttft, reply.itl, len(output.new_token_ids))
        if output.finished:
            self._forget(output.request_id)
            self.metrics.count_finished(output.finish_reason)
            if output.stats is not None:
                self.metrics.count_speculation(spec_decode_stats(output.stats, output.num_output_tokens))
        final = reply.final and state.group.finish_one()
        if reply.error is not None:
            _send(state.sender, tu.error_response(reply.error, invalid_argument=False), final=final)
        elif reply.outputs is not None:
            _send(state.sender, tu.make_response(reply.outputs), final=final)

    def finalize(self) -> None:
        self.engine.shutdown()  # unfinished requests end with "abort" outputs, answered below
        self._outputs.put(_SHUTDOWN)
        self._responder.join(timeout=10)
        # Free the custom metrics now, while the stub is whole: left to the stub's destructor (Triton 2.51),
        # each Metric's cleanup finds no shared memory and the stub dies with SIGSEGV on every shutdown.
        if not self._responder.is_alive():
            self.metrics = None  # type: ignore[assignment]
            gc.collect()


class TorchEngineModel(EngineModel):
    """TritonPythonModel for `tensorrt_llm` with backend python (pipeline/serving/templates/tensorrt_llm/1/model.py):
    inflight_batcher_llm's token-id tensors."""

    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        params = tu.ModelParameters(self.model_name, config)
        settings = engine_settings(
            params,
            params.path("gpt_model_path", tu.version_dir(args)),
            params.integer("cancellation_check_period_ms", 100, minimum=0),
        )
        # Streamed chunks end on character boundaries (RequestState): that needs the tokenizer.
        self.tokenizer = _load_tokenizer(settings.engine_dir) if self.decoupled else None
        self._start(args, settings, "gpt_model_path")

    def _parse(self, request: Any) -> list[EngineRequest] | StopRequest:
        check_no_parameters(request.parameters())
        rows = split_rows(tu.request_inputs(request, ENGINE_INPUTS), decoupled=self.decoupled)
        parsed = [
            parse_engine_request(
                row,
                self.limits,
                default_exclude_input=self.settings.exclude_input_in_output,
                decoupled=self.decoupled,
            )
            for row in rows
        ]
        if any(isinstance(row, StopRequest) for row in parsed):
            return StopRequest()
        return [row for row in parsed if isinstance(row, EngineRequest)]

    def _new_state(
        self, engine_id: str, parsed: EngineRequest, sender: Any, group: ResponseGroup, row: int | None
    ) -> RequestState:
        return RequestState(
            engine_id,
            parsed,
            sender,
            self.tokenizer,
            timeout_s=self.settings.request_timeout_s,
            row=row,
            group=group,
        )

    def _stop_acknowledgement(self) -> dict[str, np.ndarray]:
        return engine_outputs([], None, 0.0)


def _send(sender: Any, response: Any, final: bool) -> None:
    try:
        sender.send(response, flags=tu.FINAL if final else 0)
    except Exception as err:  # a cancelled or already-closed request: nothing left to tell the client
        tu.log_error(f"could not send a response: {err}")
