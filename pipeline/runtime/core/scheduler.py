"""In-flight batching: which requests compute how many tokens in the next engine step. Ints and lists only.

There is no prefill or decode phase. Every request is some tokens behind its `token_ids` (a whole prompt,
a prompt chunk, the last sampled token, plus optional draft tokens) and each step catches requests up
within `max_batch_size` sequences and `max_num_tokens` tokens: decodes first, then unfinished prompt
chunks of running requests, then waiting requests in arrival order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pipeline.config.limits import length_limit_errors
from pipeline.config.vocab import SCHEDULER_POLICIES, SchedulerPolicy
from pipeline.runtime.core.block_manager import BlockManager
from pipeline.runtime.core.metrics import EngineMetrics, MetricsSnapshot
from pipeline.runtime.core.outputs import RequestOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.stop_checker import check_stop


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 16  # sequences in flight (running) at most
    max_num_tokens: int = 2048  # tokens computed in one step, all sequences together
    max_input_len: int = 1024  # longest prompt
    max_seq_len: int = 2048  # longest prompt + output
    policy: SchedulerPolicy = "guaranteed_no_evict"  # see config.vocab
    enable_chunked_context: bool = False  # split prompts longer than the step's remaining token budget
    enable_block_reuse: bool = False  # share full KV blocks between requests with a common prefix
    # Every layer attends to this many positions at most (a model whose layers all slide): blocks that fall
    # out of the window are released as a sequence grows. None = keep every block.
    attention_window: int | None = None

    def __post_init__(self) -> None:
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"attention_window={self.attention_window} is invalid: must be >= 1 or None")
        for name in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"policy={self.policy!r} is invalid: choose one of {', '.join(SCHEDULER_POLICIES)}"
            )
        errors = length_limit_errors(
            max_input_len=self.max_input_len,
            max_seq_len=self.max_seq_len,
            max_num_tokens=self.max_num_tokens,
            max_batch_size=self.max_batch_size,
            enable_chunked_context=self.enable_chunked_context,
        )
        if errors:
            raise ValueError(errors[0])


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, tokens_per_block: int) -> None:
        self.config = config
        self.block_manager = BlockManager(num_kv_blocks, tokens_per_block, config.enable_block_reuse)
        self.metrics = EngineMetrics()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last (the preemption victim)
        self._requests: dict[str, Request] = {}  # every unfinished request by id
        self._finished_request_ids: list[str] = []  # since the last schedule()

    # --- requests in and out ---

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if a request can never run under this config. Pure: safe from any thread."""
        cfg = self.config
        if num_prompt_tokens < 1:
            raise ValueError("Prompt is empty: a request needs at least one prompt token")
        if num_prompt_tokens > cfg.max_input_len:
            raise ValueError(
                f"Prompt length ({num_prompt_tokens}) exceeds maximum input length ({cfg.max_input_len})"
            )
        num_tokens = num_prompt_tokens + params.max_tokens
        if num_tokens > cfg.max_seq_len:
            raise ValueError(
                f"Prompt length ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) = {num_tokens} "
                f"exceeds maximum sequence length ({cfg.max_seq_len})"
            )
        bm = self.block_manager
        if bm.num_blocks_for(num_tokens) > bm.num_blocks:
            raise ValueError(
                f"Prompt length + max_tokens = {num_tokens} tokens needs {bm.num_blocks_for(num_tokens)} KV blocks "
                f"of {bm.tokens_per_block} tokens but the KV cache holds {bm.num_blocks}: lower max_tokens or "
                "give the KV cache more tokens"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use by an unfinished request")
        self.check_request(request.num_prompt_tokens, request.sampling_params)
        self._requests[request.request_id] = request
        self.waiting.append(request)
        self.metrics.num_requests_added += 1
        self.metrics.num_prompt_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state; its blocks are freed at once. None if it is not unfinished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> RequestOutput | None:
        """End an unfinished request from outside a step (abort, or a runner error isolated to it)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        return self._finish(request, status, [], [], error)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> MetricsSnapshot:
        return self.metrics.snapshot(len(self.waiting), len(self.running), self.block_manager)

    # --- one step ---

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_request_ids)
        self._finished_request_ids = []
        budget = self._schedule_decodes(out, self.config.max_num_tokens)
        budget = self._schedule_prompt_chunks(out, budget)
        # A step that had to preempt is short of blocks: admitting now would only preempt again.
        if not out.preempted_request_ids:
            self._admit_waiting(out, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        num_decodes_left = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.num_tokens - request.num_computed_tokens != 1:
                i += 1
                continue
            # Drafts only use budget no later decode needs for its one token.
            num_drafts = self._num_drafts(request, budget - num_decodes_left)
            num_decodes_left -= 1
            if num_drafts and not self.block_manager.can_append(request, 1 + num_drafts):
                num_drafts = 0
            if not self._make_room(request, 1 + num_drafts, out):
                break  # the request preempted itself: it was the newest, nothing runs after it
            out.scheduled.append(ScheduledRequest(request, 1, True, num_drafts))
            budget -= 1 + num_drafts
            i += 1
        return budget

    def _num_drafts(self, request: Request, spare_budget: int) -> int:
        if not request.draft_token_ids or not request.sampling_params.allow_speculation:
            return 0
        # Accepted drafts plus the bonus token may not pass the request's length limit, so draft K/V stays
        # inside what guaranteed_no_evict reserved.
        room = self._max_len(request) - request.num_tokens - 1
        return max(0, min(len(request.draft_token_ids), spare_budget, room))

    def _make_room(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Get blocks for the request's next tokens, preempting the newest running requests if the policy
        allows; False if the request itself had to be preempted."""
        bm = self.block_manager
        while not bm.can_append(request, num_new_tokens):
            if self.config.policy == "guaranteed_no_evict":
                raise RuntimeError(
                    f"KV reservation broken: request {request.request_id!r} cannot grow under guaranteed_no_evict"
                )
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        bm.append_slots(request, num_new_tokens)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        # Recompute later from the full token_ids (prompt + outputs so far).
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.stats.num_preemptions += 1
        self.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    def _schedule_prompt_chunks(self, out: SchedulerOutput, budget: int) -> int:
        # NOTE: a running request more than one token behind is mid-prompt (chunked); its blocks were all
        # allocated at admission, so this pass never needs new blocks or preemption.
        for request in self.running:
            if budget <= 0:
                break
            num_behind = request.num_tokens - request.num_computed_tokens
            if num_behind <= 1:
                continue
            num_new = min(num_behind, budget)
            out.scheduled.append(ScheduledRequest(request, num_new, sample=num_new == num_behind))
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        bm = self.block_manager
        no_evict = cfg.policy == "guaranteed_no_evict"
        num_reserved = self._num_reserved_blocks() if no_evict else 0
        while self.waiting and budget > 0 and len(self.running) < cfg.max_batch_size:
            request = self.waiting[0]
            # NOTE: a request that wants its context logits recomputes a cached prefix (its K/V are
            # rewritten with the same values) rather than skip the positions whose logits it needs.
            recompute = request.sampling_params.context_logits
            num_behind = request.num_tokens - (0 if recompute else bm.get_num_cached_tokens(request))
            # A recomputed request can outgrow a whole step; it is chunked even with chunking off.
            can_chunk = cfg.enable_chunked_context or num_behind > cfg.max_num_tokens
            if num_behind > budget and not can_chunk:
                break
            if no_evict:
                if not bm.can_allocate(request, self._max_len(request), num_reserved):
                    break
            elif not bm.can_allocate(request):
                break
            self.waiting.popleft()
            num_cached = bm.allocate(request)
            request.num_computed_tokens = 0 if recompute else num_cached
            if no_evict:
                num_reserved += bm.num_blocks_for(self._max_len(request)) - len(request.block_table)
            self._start_running(request)
            num_new = min(num_behind, budget)
            out.scheduled.append(ScheduledRequest(request, num_new, sample=num_new == num_behind))
            budget -= num_new

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        stats = request.stats
        if stats.first_scheduled_time is None:
            stats.first_scheduled_time = time.monotonic()
            stats.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.metrics.queue_time.observe(stats.first_scheduled_time - stats.arrival_time)

    def _max_len(self, request: Request) -> int:
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_seq_len)

    def _num_reserved_blocks(self) -> int:
        """Blocks running requests may still claim before reaching their length limit."""
        bm = self.block_manager
        return sum(bm.num_blocks_for(self._max_len(r)) - len(r.block_table) for r in self.running)

    # --- after the runner ---

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's sampled tokens: advance, stop-check, free finished requests, roll back drafts."""
        scheduled = scheduler_output.scheduled
        sampled_token_ids = runner_output.sampled_token_ids
        if len(sampled_token_ids) != len(scheduled):
            raise RuntimeError(
                f"runner returned {len(sampled_token_ids)} token lists for {len(scheduled)} scheduled requests"
            )
        now = time.monotonic()
        self.metrics.num_steps += 1
        self.metrics.num_batched_tokens += scheduler_output.num_batched_tokens
        outputs: list[RequestOutput] = []
        for i, sched in enumerate(scheduled):
            request = sched.request
            if request.status != RequestStatus.RUNNING:
                continue  # finished while the step ran (e.g. isolated runner error)
            logprobs = runner_output.logprobs[i] if runner_output.logprobs is not None else None
            context = runner_output.context_logits[i] if runner_output.context_logits is not None else None
            if context is not None:
                request.add_context_logits(context.start, context.rows)
            generation = runner_output.generation_logits
            output = self._update_request(
                sched, sampled_token_ids[i], logprobs, now, generation[i] if generation is not None else None
            )
            if output is not None:
                outputs.append(output)
        if any(o.finished for o in outputs):
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _update_request(
        self,
        sched: ScheduledRequest,
        sampled: list[int],
        logprobs: list[float] | None,
        now: float,
        generation_logits: Any | None = None,
    ) -> RequestOutput | None:
        request = sched.request
        num_expected = (1, 1 + sched.num_draft_tokens) if sched.sample else (0, 0)
        if not num_expected[0] <= len(sampled) <= num_expected[1]:
            error = f"runner returned {len(sampled)} tokens, expected {num_expected[0]}..{num_expected[1]}"
            return self._finish(request, RequestStatus.FINISHED_ERROR, [], [], error)
        # The runner's accepted tokens start with the accepted drafts, whose K/V it computed; the last one
        # (bonus or correction) has no K/V yet.
        num_accepted_drafts = len(sampled) - 1 if sched.num_draft_tokens else 0
        request.num_computed_tokens += sched.num_new_tokens + num_accepted_drafts
        if sched.num_draft_tokens:
            request.stats.num_draft_tokens += sched.num_draft_tokens
            request.stats.num_accepted_draft_tokens += num_accepted_drafts
            self.metrics.num_draft_tokens += sched.num_draft_tokens
            self.metrics.num_accepted_draft_tokens += num_accepted_drafts
        request.draft_token_ids = []
        new_token_ids: list[int] = []
        new_logprobs: list[float] = []
        status = None
        want_logprobs = logprobs is not None and request.sampling_params.logprobs
        for j, token_id in enumerate(sampled):
            request.token_ids.append(token_id)
            new_token_ids.append(token_id)
            if want_logprobs:
                assert logprobs is not None
                request.output_logprobs.append(logprobs[j])
                new_logprobs.append(logprobs[j])
            status = check_stop(
                request.token_ids, request.num_prompt_tokens, request.sampling_params, self.config.max_seq_len
            )
            if status is not None:
                break
        if new_token_ids:
            self.metrics.record_tokens(request, len(new_token_ids), now)
        logits = None if generation_logits is None else generation_logits[: len(new_token_ids)]
        if status is not None:
            # Tokens after the stop were dropped; at most the tokens kept have K/V worth publishing.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.block_manager.publish_computed_blocks(request)
            return self._finish(
                request, status, new_token_ids, new_logprobs, None, remove=False, logits=logits
            )
        self.block_manager.publish_computed_blocks(request)
        if sched.num_draft_tokens:
            self.block_manager.trim(request, request.num_tokens)
        if self.config.attention_window is not None:
            self.block_manager.release_out_of_window(request, self.config.attention_window)
        if not new_token_ids:
            return None
        return self._output(request, new_token_ids, new_logprobs, logits)

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        new_token_ids: list[int],
        new_logprobs: list[float],
        error: str | None,
        remove: bool = True,
        logits: Any | None = None,
    ) -> RequestOutput:
        """Mark finished and free blocks; `remove=False` leaves dropping it from `running` to the caller."""
        if remove and request in self.running:
            self.running.remove(request)
        request.status = status
        request.error = error
        request.draft_token_ids = []
        self.block_manager.free(request)
        del self._requests[request.request_id]
        self._finished_request_ids.append(request.request_id)
        self.metrics.record_finished(request, time.monotonic())
        return self._output(request, new_token_ids, new_logprobs, logits)

    def _output(
        self,
        request: Request,
        new_token_ids: list[int],
        new_logprobs: list[float],
        generation_logits: Any | None = None,
    ) -> RequestOutput:
        finished = request.status.finished
        # The prompt's logits go out with the first output token, once every prompt position is computed;
        # the request lets go of them then (num_context_logits still skips any recomputation).
        context = None
        if request.context_logits and new_token_ids and request.num_output_tokens == len(new_token_ids):
            context, request.context_logits = request.context_logits, []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.stats.num_cached_tokens,
            error=request.error,
            stats=request.stats if finished else None,
            context_logits=context,
            new_generation_logits=generation_logits,
        )
