"""Scheduler/engine test helpers: configs, requests, and a fake runner with a fake paged KV cache.

FakeRunner stands in for the model. It writes each computed token's id into the slot its block table
names, and samples `fake_next_token(tokens read back through the block table)`. So a wrong block table,
a lost write, a block shared or freed too early, or a bad recompute changes the output, and every test
can compare against `reference_output`, the same function applied to plain lists.
"""

from __future__ import annotations

import zlib
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import Any

from pipeline.runtime.core.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import Scheduler, SchedulerConfig
from pipeline.runtime.core.stop_checker import check_stop
from pipeline.runtime.engine.llm_engine import LLMEngine

VOCAB_SIZE = 64
WRONG_TOKEN = 10_000  # a draft token FakeRunner never samples
DEFAULT_LIMITS: dict[str, Any] = {
    "max_batch_size": 8,
    "max_num_tokens": 64,
    "max_input_len": 64,
    "max_seq_len": 128,
}


def fake_next_token(token_ids: list[int]) -> int:
    """The fake model: a deterministic function of the whole prefix."""
    return zlib.crc32(array("i", token_ids).tobytes()) % VOCAB_SIZE


def fake_logprob(token_id: int) -> float:
    return -token_id / 100.0


def reference_output(
    prompt: list[int], params: SamplingParams, max_seq_len: int = 10**9, window: int | None = None
) -> list[int]:
    """What a correct engine returns for `prompt` with FakeRunner (attending to the last `window` tokens)."""
    token_ids = list(prompt)
    while True:
        token_ids.append(fake_next_token(token_ids[-window:] if window else token_ids))
        if check_stop(token_ids, len(prompt), params, max_seq_len) is not None:
            return token_ids[len(prompt) :]


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        tokens_per_block: int,
        fail_request_ids: Iterable[str] = (),
        window: int | None = None,
    ) -> None:
        self.window = window  # like a sliding-window model: each token reads only the last `window` slots
        self.num_kv_blocks = num_kv_blocks
        self.tokens_per_block = tokens_per_block
        self.kv: list[int | None] = [None] * (num_kv_blocks * tokens_per_block)
        self.fail_request_ids = set(fail_request_ids)  # any step holding one of these raises
        self.num_calls = 0
        self.seen_finished_ids: list[str] = []
        self.seen_preempted_ids: list[str] = []

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.num_calls += 1
        self.seen_finished_ids += scheduler_output.finished_request_ids
        self.seen_preempted_ids += scheduler_output.preempted_request_ids
        failing = [
            s.request.request_id
            for s in scheduler_output.scheduled
            if s.request.request_id in self.fail_request_ids
        ]
        if failing:
            raise RuntimeError(f"fake failure for {failing}")
        sampled: list[list[int]] = []
        logprobs: list[list[float]] = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            start = request.num_computed_tokens
            drafts = request.draft_token_ids[: sched.num_draft_tokens]
            for offset, token_id in enumerate(
                request.token_ids[start : start + sched.num_new_tokens] + drafts
            ):
                self.kv[self._slot(request.block_table, start + offset)] = token_id
            tokens: list[int] = []
            if sched.sample:
                end = start + sched.num_new_tokens
                for j in range(sched.num_draft_tokens + 1):
                    tokens.append(fake_next_token(self._read(request.block_table, end + j)))
                    if j == sched.num_draft_tokens or drafts[j] != tokens[-1]:
                        break
            sampled.append(tokens)
            logprobs.append([fake_logprob(t) for t in tokens])
        return RunnerOutput(sampled, logprobs)

    def _slot(self, block_table: list[int], position: int) -> int:
        block_index, offset = divmod(position, self.tokens_per_block)
        assert block_index < len(block_table), f"position {position} has no block in {block_table}"
        return block_table[block_index] * self.tokens_per_block + offset

    def _read(self, block_table: list[int], num_tokens: int) -> list[int]:
        first = max(0, num_tokens - self.window) if self.window else 0
        token_ids = [self.kv[self._slot(block_table, p)] for p in range(first, num_tokens)]
        assert None not in token_ids, "read a KV slot that was never written"
        return token_ids  # type: ignore[return-value]


def make_config(**overrides: Any) -> SchedulerConfig:
    return SchedulerConfig(**{**DEFAULT_LIMITS, **overrides})


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **overrides: Any) -> Scheduler:
    return Scheduler(make_config(**overrides), num_blocks, block_size)


def make_engine(num_blocks: int = 64, block_size: int = 4, **overrides: Any) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks, block_size)
    return LLMEngine(runner, make_config(**overrides)), runner


def make_prompt(index: int, num_tokens: int, prefix: list[int] | None = None) -> list[int]:
    body = [(index * 7919 + j * 31) % 997 + 1 for j in range(num_tokens - len(prefix or []))]
    return list(prefix or []) + body


def make_requests(
    n: int,
    num_tokens: int,
    max_tokens: int = 8,
    prefix: list[int] | None = None,
    start: int = 0,
    **params: Any,
) -> list[Request]:
    """`n` requests with distinct `num_tokens`-token prompts (sharing `prefix` if given)."""
    sampling_params = SamplingParams(max_tokens=max_tokens, **params)
    return [
        Request(f"req-{i}", make_prompt(i, num_tokens, prefix), sampling_params)
        for i in range(start, start + n)
    ]


def check_step_limits(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
    cfg = scheduler.config
    assert len(scheduler_output.scheduled) <= cfg.max_batch_size
    assert scheduler_output.num_batched_tokens <= cfg.max_num_tokens
    assert len(scheduler.running) <= cfg.max_batch_size
    ids = [s.request.request_id for s in scheduler_output.scheduled]
    assert len(ids) == len(set(ids)), f"a request was scheduled twice: {ids}"
    for sched in scheduler_output.scheduled:
        assert sched.num_new_tokens >= 1
        assert sched.request.num_computed_tokens + sched.num_new_tokens <= sched.request.num_tokens


def check_blocks(scheduler: Scheduler) -> None:
    """No block leaked, double-counted or freed while referenced."""
    bm = scheduler.block_manager
    refs: Counter[int] = Counter()
    for request in scheduler.running:
        refs.update(request.block_table[request.num_released_blocks :])
        assert len(request.block_table) >= bm.num_blocks_for(request.num_computed_tokens)
    for request in scheduler.waiting:
        assert request.block_table == [], f"waiting {request.request_id} holds blocks"
    assert [bm.ref_counts[b] for b in range(bm.num_blocks)] == [refs[b] for b in range(bm.num_blocks)]
    free_ids = list(bm._free_block_ids) + list(bm._cached_free)
    assert len(free_ids) == len(set(free_ids)), "a block is in the free pools twice"
    assert set(free_ids) == {b for b in range(bm.num_blocks) if refs[b] == 0}
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def run_scheduler(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    """Step until idle, checking limits and block accounting every step; outputs by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        scheduler_output = scheduler.schedule()
        check_step_limits(scheduler, scheduler_output)
        for output in scheduler.update(scheduler_output, runner.execute(scheduler_output)):
            outputs.setdefault(output.request_id, []).append(output)
        check_blocks(scheduler)
    raise AssertionError(f"not finished after {max_steps} steps")


def output_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
