"""EngineThread: one background thread owns an LLMEngine; other threads submit, stream, cancel.

Callers never touch the engine: `submit`/`abort` hand work to the engine thread through an inbox under one
lock and a condition, and the thread applies them between steps, so a cancellation lands within one
step. With no work the thread sleeps on the condition; it never spins.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from pipeline.errors import PipelineError
from pipeline.runtime.core.metrics import MetricsSnapshot
from pipeline.runtime.core.outputs import RequestOutput
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.util.openmp import release_thread_workers

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
CancelCheck = Callable[[], bool]


class QueueFullError(PipelineError):
    """The engine already holds `max_pending` unfinished requests; the new one was rejected."""


class EngineDeadError(PipelineError):
    """The engine thread stopped (shutdown, or an engine bug); no request can be served."""


class RequestStream:
    """The RequestOutput deltas of one request, ending with the output where `finished` is True.

    Iterate it (blocking), or pass `callback` to `submit` to get each output on the engine thread instead
    (the callback must be quick; it may call `abort`/`submit`, never `shutdown`).
    """

    def __init__(
        self,
        request_id: str,
        owner: EngineThread,
        callback: OutputCallback | None = None,
        is_cancelled: CancelCheck | None = None,
    ) -> None:
        self.request_id = request_id
        self._owner = owner
        self._callback = callback
        self._is_cancelled = is_cancelled
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False  # set once the final output was consumed (or passed to the callback)

    def cancel(self) -> None:
        """Abort the request; the stream still ends with a finish_reason "abort" output."""
        self._owner.abort(self.request_id)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises queue.Empty after `timeout` seconds without one."""
        output = self._queue.get(timeout=timeout)
        self.finished = output.finished
        return output

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def _deliver(self, output: RequestOutput) -> None:
        if self._callback is None:
            self._queue.put(output)
            return
        self.finished = output.finished
        try:
            self._callback(output)
        except Exception:
            logger.exception("output callback of request %r failed", self.request_id)


class EngineThread:
    def __init__(self, engine: LLMEngine, max_pending: int = 64, name: str = "llm-engine") -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} is invalid: must be >= 1")
        self.engine = engine
        self.max_pending = max_pending
        self._cond = threading.Condition()
        # Guarded by _cond: the inbox the engine thread drains, and every unfinished request's stream.
        self._new: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._dead_reason: str | None = None
        # Only the engine thread touches the engine; it publishes a snapshot after every step and admission
        # round, so stats() (the Triton responder calls it between sends) never waits for a step to end.
        self._stats = engine.stats()
        # The engine was loaded on this thread (by every caller that makes one); left alive, this thread's OpenMP
        # workers would make the engine thread's team sleep at every barrier (see pipeline/util/openmp.py).
        release_thread_workers()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __enter__(self) -> EngineThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- caller side (any thread) ---

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        callback: OutputCallback | None = None,
        is_cancelled: CancelCheck | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError if it can never run, QueueFullError past `max_pending`.

        `is_cancelled` (e.g. Triton's `response_sender.is_cancelled`) is polled on the engine thread before
        every step; True aborts the request, like `cancel()`.
        """
        params = params or SamplingParams()
        self.engine.check_request(len(prompt_ids), params)
        with self._cond:
            if self._dead_reason is not None:
                raise EngineDeadError(f"engine is not running: {self._dead_reason}")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
            if len(self._streams) >= self.max_pending:
                raise QueueFullError(
                    f"engine queue is full ({len(self._streams)} unfinished requests, max_pending={self.max_pending})",
                    hint="retry later, or raise the engine's max_pending / serving.max_queue_size",
                )
            stream = RequestStream(request_id, self, callback, is_cancelled)
            self._streams[request_id] = stream
            self._new.append((request_id, list(prompt_ids), params))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request; a no-op if it already finished."""
        with self._cond:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._cond.notify()

    def num_pending(self) -> int:
        with self._cond:
            return len(self._streams)

    def stats(self) -> MetricsSnapshot:
        """The engine's counters as of its last step or admission round."""
        return self._stats

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; requests still unfinished end with finish_reason "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # --- engine thread ---

    def _run(self) -> None:
        try:
            while self._next_round():
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                self._stats = self.engine.stats()
                self._dispatch(outputs)
        except Exception as exc:
            logger.exception("engine thread died")
            self._close(f"engine failed: {type(exc).__name__}: {exc}", "error")
        else:
            self._close("engine shut down", "abort")

    def _next_round(self) -> bool:
        """Wait for work, apply queued submissions and aborts; False once shutting down."""
        with self._cond:
            while not (self._stopping or self._new or self._aborts or self.engine.has_unfinished()):
                self._cond.wait()
            if self._stopping:
                return False
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            checks = [(s.request_id, s._is_cancelled) for s in self._streams.values() if s._is_cancelled]
        aborts += [request_id for request_id, is_cancelled in checks if _cancelled(request_id, is_cancelled)]
        outputs: list[RequestOutput] = []
        for request_id, prompt_ids, params in new:
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except ValueError as exc:  # submit() checked already; only a racing duplicate id lands here
                outputs.append(_final_output(request_id, "error", str(exc)))
        for request_id in aborts:
            output = self.engine.abort(request_id)
            if output is not None:
                outputs.append(output)
        if new or aborts:
            self._stats = self.engine.stats()
        self._dispatch(outputs)
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._cond:
            streams = [self._streams.get(o.request_id) for o in outputs]
            for output in outputs:
                if output.finished:
                    self._streams.pop(output.request_id, None)
        for stream, output in zip(streams, outputs, strict=True):
            if stream is not None:
                stream._deliver(output)

    def _close(self, reason: str, finish_reason: str) -> None:
        """End every stream still open, so no caller waits forever on a stopped engine."""
        with self._cond:
            self._dead_reason = reason
            streams, self._streams = self._streams, {}
            self._new.clear()
            self._aborts.clear()
        for request_id, stream in streams.items():
            stream._deliver(
                _final_output(request_id, finish_reason, reason if finish_reason == "error" else None)
            )


def _cancelled(request_id: str, is_cancelled: CancelCheck) -> bool:
    try:
        return bool(is_cancelled())
    except Exception:
        logger.exception("cancellation check of request %r failed", request_id)
        return False


def _final_output(request_id: str, finish_reason: str, error: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_logprobs=[],
        finished=True,
        finish_reason=finish_reason,
        num_prompt_tokens=0,
        num_output_tokens=0,
        error=error,
    )
