"""One served request's life in the engine model: engine outputs in, response tensors out. No Triton here.

Semantics are tensorrtllm_backend's: a streaming request gets the new tokens in each response (the prompt
never), a non-streaming one gets a single response with every output token (after the prompt tokens when
exclude_input_in_output is false). The last response carries the final flag together with its data, so a
one-response request also works through HTTP `/generate`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.runtime.core.outputs import RequestOutput
from pipeline.serving.triton_models.detokenizer import IncrementalDetokenizer
from pipeline.serving.triton_models.io import EngineRequest, batch_index, engine_outputs, speculative_outputs


@dataclass
class Reply:
    """What to send for one engine output."""

    outputs: dict[str, np.ndarray] | None  # None: send nothing now (tokens held back)
    final: bool
    error: str | None = None
    # latency samples for the metrics, in seconds
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)


class ResponseGroup:
    """The sequences (rows) of one Triton request: they share its response sender, and only the last of
    them to finish sends the final flag. Rows finish on the responder thread, or on Triton's thread when
    their submission fails, hence the lock."""

    def __init__(self, size: int) -> None:
        self.remaining = size
        self._lock = threading.Lock()

    def finish_one(self) -> bool:
        """Count one row as done; True when it was the last."""
        with self._lock:
            self.remaining -= 1
            return self.remaining == 0


class RequestState:
    def __init__(
        self,
        engine_id: str,
        request: EngineRequest,
        sender: Any,
        tokenizer: Any | None = None,
        arrival_time: float | None = None,
        timeout_s: float | None = None,
        row: int | None = None,
        group: ResponseGroup | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.row = row  # this sequence's row in a request of several (its responses carry batch_index)
        self.group = group or ResponseGroup(1)
        self.request = request
        self.sender = sender
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = None if timeout_s is None else self.arrival_time + timeout_s
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.logprob_sum = 0.0  # of self.logprobs, kept as they arrive (streams report it every chunk)
        self.num_sent = 0
        self.cum_sent_logprob = 0.0
        # return_context_logits: [prompt, vocab], sent with the first tokens; return_generation_logits: one
        # [vocab] row per token not yet sent (dropped once sent: vocabulary-sized each)
        self.context_logits: np.ndarray | None = None
        self.generation_logits: list[np.ndarray] = []
        self.last_token_time: float | None = None
        # Streaming chunks end on character boundaries so that a stateless detokenizer downstream (the
        # ensemble's postprocessing) decodes each chunk exactly: held-back tokens wait for the next step.
        self._boundary = (
            IncrementalDetokenizer(tokenizer, request.prompt_ids[-8:], skip_special_tokens=False)
            if tokenizer is not None and request.streaming
            else None
        )

    def timed_out(self, now: float | None = None) -> bool:
        """Polled by the engine before each step (a local check: no IPC on the engine thread)."""
        return self.deadline is not None and (time.monotonic() if now is None else now) > self.deadline

    def _latency(self, reply: Reply, num_new: int, now: float) -> None:
        if num_new == 0:
            return
        if self.last_token_time is None:
            reply.ttft = now - self.arrival_time
        else:
            reply.itl = [(now - self.last_token_time) / num_new] * num_new
        self.last_token_time = now

    def on_output(self, output: RequestOutput, now: float | None = None) -> Reply:
        now = time.monotonic() if now is None else now
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        self.logprob_sum += sum(output.new_logprobs)
        if output.context_logits is not None:
            self.context_logits = np.concatenate(output.context_logits)
        if output.new_generation_logits is not None:
            self.generation_logits += list(output.new_generation_logits)
        if output.error is not None or output.finish_reason == "error":
            reply = Reply(
                None, final=True, error=f"request failed in the engine: {output.error or 'unknown error'}"
            )
        elif output.finish_reason == "abort" and self.timed_out(now):
            assert self.deadline is not None
            limit = self.deadline - self.arrival_time
            reply = Reply(
                None, final=True, error=f"request timed out after {limit:g}s (serving.request_timeout_s)"
            )
        elif self.request.streaming:
            reply = self._stream_reply(output)
        elif output.finished:
            reply = Reply(self._full_outputs(output), final=True)
        else:
            reply = Reply(None, final=False)
        if reply.final and reply.outputs is not None and self.request.return_perf_metrics:
            reply.outputs.update(self._perf_outputs(output))
        if reply.outputs is not None and self.row is not None:
            reply.outputs.update(batch_index(self.row))
        self._latency(reply, len(output.new_token_ids), now)
        return reply

    def _perf_outputs(self, output: RequestOutput) -> dict[str, np.ndarray]:
        """What return_perf_metrics adds to the final response."""
        if output.stats is None:
            return speculative_outputs(0, 0)
        return speculative_outputs(output.stats.num_draft_tokens, output.stats.num_accepted_draft_tokens)

    def _stream_reply(self, output: RequestOutput) -> Reply:
        ready = len(self.token_ids)
        if self._boundary is not None and not output.finished:
            self._boundary.add(output.new_token_ids)
            ready = self._boundary.num_emitted_tokens
        chunk = self.token_ids[self.num_sent : ready]
        if not chunk and not output.finished:
            return Reply(None, final=False)
        chunk_logprobs = self.logprobs[self.num_sent : ready] if self.request.params.logprobs else None
        self.cum_sent_logprob += sum(chunk_logprobs or ())
        outputs = engine_outputs(
            chunk, chunk_logprobs, self.cum_sent_logprob, *self._logits(ready - self.num_sent)
        )
        self.context_logits = None  # sent once, with the first tokens
        self.num_sent = ready
        return Reply(outputs, final=output.finished)

    def _logits(self, num_tokens: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The context logits not yet sent and the generation logits of the next `num_tokens` tokens to
        send, as asked."""
        params = self.request.params
        generation = None
        if params.generation_logits:
            rows = self.generation_logits[:num_tokens]
            del self.generation_logits[:num_tokens]
            generation = np.stack(rows) if rows else np.zeros((0, 0), np.float32)  # [tokens, vocab]
        return (self.context_logits if params.context_logits else None), generation

    def _full_outputs(self, output: RequestOutput) -> dict[str, np.ndarray]:
        tokens = (
            self.token_ids
            if self.request.exclude_input_in_output
            else self.request.prompt_ids + self.token_ids
        )
        logprobs = self.logprobs if self.request.params.logprobs else None
        return engine_outputs(tokens, logprobs, sum(logprobs or ()), *self._logits(len(self.token_ids)))
