"""Scheduler: budgets, chunked context, policies, preemption, reuse, drafts, aborts, stop checks.

Runs with FakeRunner (tests/helpers.py), whose tokens depend on the K/V read back through the block
tables, so "outputs equal reference_output" also proves the paged-KV bookkeeping right.
"""

from __future__ import annotations

import pytest

from pipeline.runtime.core.outputs import SchedulerOutput
from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import SchedulerConfig
from tests.helpers import (
    WRONG_TOKEN,
    FakeRunner,
    check_blocks,
    check_step_limits,
    make_prompt,
    make_requests,
    make_scheduler,
    output_tokens,
    reference_output,
    run_scheduler,
)


def _step(scheduler, runner) -> tuple[SchedulerOutput, list]:
    scheduler_output = scheduler.schedule()
    check_step_limits(scheduler, scheduler_output)
    outputs = scheduler.update(scheduler_output, runner.execute(scheduler_output))
    check_blocks(scheduler)
    return scheduler_output, outputs


def _shape(scheduler_output: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.sample) for s in scheduler_output.scheduled]


# --- admission checks ---


def test_rejects_requests_that_can_never_run() -> None:
    scheduler = make_scheduler(
        num_blocks=8, block_size=4, max_input_len=16, max_seq_len=32, max_num_tokens=16
    )
    with pytest.raises(ValueError, match=r"Prompt length \(17\) exceeds maximum input length \(16\)"):
        scheduler.add_request(make_requests(1, 17)[0])
    with pytest.raises(
        ValueError,
        match=r"Prompt length \(10\) \+ max_tokens \(23\) = 33 exceeds maximum sequence length \(32\)",
    ):
        scheduler.add_request(make_requests(1, 10, max_tokens=23)[0])
    with pytest.raises(ValueError, match="Prompt is empty"):
        scheduler.add_request(Request("empty", [], SamplingParams()))
    small = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"needs 3 KV blocks of 4 tokens but the KV cache holds 2"):
        small.add_request(make_requests(1, 4, max_tokens=8)[0])
    request = make_requests(1, 4)[0]
    scheduler.add_request(request)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_requests(1, 4)[0])
    assert not small.has_unfinished()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"policy": "fcfs"}, "policy='fcfs' is invalid"),
        ({"max_input_len": 200}, "max_input_len=200 exceeds max_seq_len=128"),
        ({"max_num_tokens": 16}, "max_num_tokens=16 < max_input_len=64 with enable_chunked_context=false"),
        ({"max_batch_size": 0}, "max_batch_size=0 is invalid"),
    ],
)
def test_config_errors_name_the_value(overrides: dict, message: str) -> None:
    limits = {"max_batch_size": 8, "max_num_tokens": 64, "max_input_len": 64, "max_seq_len": 128}
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{**limits, **overrides})


# --- budgets and chunking ---


def test_chunked_prompt_samples_only_on_its_last_chunk() -> None:
    scheduler = make_scheduler(max_num_tokens=8, max_input_len=32, enable_chunked_context=True)
    runner = FakeRunner(64, 4)
    (request,) = make_requests(1, 20, max_tokens=2)
    scheduler.add_request(request)
    shapes = []
    tokens = []
    while scheduler.has_unfinished():
        scheduler_output, outputs = _step(scheduler, runner)
        shapes.append(_shape(scheduler_output))
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert shapes == [
        [("req-0", 8, False)],
        [("req-0", 8, False)],
        [("req-0", 4, True)],
        [("req-0", 1, True)],
    ]
    assert tokens == reference_output(request.prompt_token_ids, request.sampling_params)


def test_without_chunking_a_prompt_waits_until_it_fits_whole() -> None:
    scheduler = make_scheduler(max_num_tokens=16, max_input_len=16)
    runner = FakeRunner(64, 4)
    for request in make_requests(2, 10, max_tokens=3):
        scheduler.add_request(request)
    first, _ = _step(scheduler, runner)
    second, _ = _step(scheduler, runner)
    assert _shape(first) == [("req-0", 10, True)]
    assert _shape(second) == [("req-0", 1, True), ("req-1", 10, True)]


def test_decodes_go_first_then_running_chunks_then_new_prompts() -> None:
    scheduler = make_scheduler(max_num_tokens=12, max_input_len=32, enable_chunked_context=True)
    runner = FakeRunner(64, 4)
    a, b, c = make_requests(3, 8, max_tokens=4)
    scheduler.add_request(a)
    _step(scheduler, runner)
    b.prompt_token_ids = b.token_ids = make_prompt(1, 20)
    scheduler.add_request(b)
    step2, _ = _step(scheduler, runner)
    assert _shape(step2) == [("req-0", 1, True), ("req-1", 11, False)]
    scheduler.add_request(c)
    step3, _ = _step(scheduler, runner)
    assert _shape(step3) == [("req-0", 1, True), ("req-1", 9, True), ("req-2", 2, False)]


def test_running_never_exceeds_max_batch_size() -> None:
    scheduler = make_scheduler(max_batch_size=2)
    runner = FakeRunner(64, 4)
    requests = make_requests(5, 6, max_tokens=3)
    for request in requests:
        scheduler.add_request(request)
    first, _ = _step(scheduler, runner)
    assert [s.request.request_id for s in first.scheduled] == ["req-0", "req-1"]
    outputs = run_scheduler(scheduler, runner)
    for request in requests[2:]:
        assert output_tokens(outputs[request.request_id]) == reference_output(
            request.prompt_token_ids, request.sampling_params
        )


# --- policies ---


def test_guaranteed_no_evict_reserves_whole_sequences_and_never_preempts() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, policy="guaranteed_no_evict")
    runner = FakeRunner(8, 4)
    requests = make_requests(3, 4, max_tokens=12)  # 16 tokens = 4 blocks each, at most 2 at once
    for request in requests:
        scheduler.add_request(request)
    first, _ = _step(scheduler, runner)
    assert [s.request.request_id for s in first.scheduled] == ["req-0", "req-1"]
    steps_before_third = 1
    while requests[2].status == RequestStatus.WAITING:
        _step(scheduler, runner)
        steps_before_third += 1
        assert scheduler.block_manager.num_used_blocks <= 8
    assert requests[0].status.finished and requests[1].status.finished
    run_scheduler(scheduler, runner)
    assert scheduler.metrics.num_preemptions == 0
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling_params)


def test_max_utilization_preempts_the_newest_and_recomputes_the_same_tokens() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, policy="max_utilization")
    runner = FakeRunner(6, 4)
    requests = make_requests(3, 4, max_tokens=12)
    for request in requests:
        scheduler.add_request(request)
    preempted: list[str] = []
    while scheduler.has_unfinished():
        scheduler_output, _ = _step(scheduler, runner)
        if scheduler_output.preempted_request_ids and not preempted:
            preempted = list(scheduler_output.preempted_request_ids)
            assert preempted == ["req-2"]
            assert scheduler.waiting[0] is requests[2]
            assert requests[2].num_computed_tokens == 0 and requests[2].num_output_tokens > 0
    assert preempted
    assert scheduler.metrics.num_preemptions >= 1 and requests[2].stats.num_preemptions >= 1
    assert "req-2" in runner.seen_preempted_ids
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling_params)
    assert scheduler.block_manager.num_free_blocks == 6


def test_a_recompute_longer_than_the_step_budget_is_chunked_even_with_chunking_off() -> None:
    scheduler = make_scheduler(
        num_blocks=20,
        block_size=2,
        policy="max_utilization",
        max_num_tokens=16,
        max_input_len=8,
        max_seq_len=40,
    )
    runner = FakeRunner(20, 2)
    requests = make_requests(2, 8, max_tokens=30)
    for request in requests:
        scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished():
        scheduler_output, _ = _step(scheduler, runner)
        chunks += [s for s in scheduler_output.scheduled if not s.sample]
    assert scheduler.metrics.num_preemptions >= 1
    assert chunks, "the recompute of more than max_num_tokens tokens must be split"
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling_params)


# --- prefix reuse through the scheduler ---


def test_reuse_skips_the_cached_prefix_and_keeps_shared_blocks_alive() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, enable_block_reuse=True)
    runner = FakeRunner(32, 4)
    prefix = make_prompt(500, 12)
    a, b = make_requests(2, 18, max_tokens=6, prefix=prefix)
    scheduler.add_request(a)
    _step(scheduler, runner)  # a's prompt computed and published
    scheduler.add_request(b)
    step, _ = _step(scheduler, runner)
    assert _shape(step) == [("req-0", 1, True), ("req-1", 18 - 12, True)]
    assert b.stats.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    scheduler.abort("req-0")  # the shared blocks stay referenced by b
    check_blocks(scheduler)
    outputs = run_scheduler(scheduler, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params)
    assert outputs["req-1"][-1].num_cached_tokens == 12
    stats = scheduler.stats()
    assert (stats.num_reuse_hits, stats.num_kv_blocks_reused) == (1, 3)
    assert stats.num_kv_blocks_cached_free > 0 and stats.num_kv_blocks_used == 0


# --- speculative decoding ---


def test_drafts_are_verified_and_rejected_kv_is_rolled_back() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=2)
    runner = FakeRunner(32, 2)
    (request,) = make_requests(1, 5, max_tokens=12)
    reference = reference_output(request.prompt_token_ids, request.sampling_params)
    scheduler.add_request(request)
    _step(scheduler, runner)  # prefill: 1 output
    request.draft_token_ids = reference[1:4]  # all three right
    step, outputs = _step(scheduler, runner)
    assert step.scheduled[0].num_draft_tokens == 3
    assert outputs[0].new_token_ids == reference[1:5]  # 3 drafts + the bonus token
    assert request.num_computed_tokens == request.num_tokens - 1
    request.draft_token_ids = [reference[5], WRONG_TOKEN, WRONG_TOKEN, WRONG_TOKEN]
    scheduler_output = scheduler.schedule()
    assert len(request.block_table) == scheduler.block_manager.num_blocks_for(request.num_computed_tokens + 5)
    outputs = scheduler.update(scheduler_output, runner.execute(scheduler_output))
    assert outputs[0].new_token_ids == reference[5:7]  # one accepted, then the correction
    assert len(request.block_table) == scheduler.block_manager.num_blocks_for(request.num_tokens)
    check_blocks(scheduler)
    run_scheduler(scheduler, runner)
    assert request.output_token_ids == reference
    assert (request.stats.num_draft_tokens, request.stats.num_accepted_draft_tokens) == (7, 4)
    assert scheduler.stats().draft_acceptance_rate == pytest.approx(4 / 7)


def test_drafts_fit_the_token_budget_and_the_length_limit() -> None:
    scheduler = make_scheduler(max_num_tokens=4, max_input_len=4, max_batch_size=2)
    runner = FakeRunner(64, 4)
    a, b = make_requests(2, 2, max_tokens=5)
    for request in (a, b):
        scheduler.add_request(request)
    _step(scheduler, runner)
    a.draft_token_ids = [1] * 10
    b.draft_token_ids = [1] * 10
    step = scheduler.schedule()
    # Each decode keeps its own token; a takes what is left (4 - 2 = 2 drafts).
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in step.scheduled] == [(1, 2), (1, 0)]
    scheduler.update(step, runner.execute(step))
    a.draft_token_ids = [1] * 10
    # a holds n outputs; at most max_tokens - n tokens may follow: one sampled plus the drafts.
    room = a.sampling_params.max_tokens - a.num_output_tokens - 1
    step = scheduler.schedule()
    assert step.scheduled[0].num_draft_tokens == min(room, 3)


def test_a_stop_inside_accepted_drafts_drops_the_tokens_after_it() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=2)
    runner = FakeRunner(32, 2)
    prompt = make_prompt(3, 5)
    plain = reference_output(prompt, SamplingParams(max_tokens=12))
    end_id = plain[3]
    params = SamplingParams(max_tokens=12, end_id=end_id)
    reference = reference_output(prompt, params)
    request = Request("r", prompt, params)
    scheduler.add_request(request)
    _step(scheduler, runner)
    request.draft_token_ids = plain[len(request.output_token_ids) : 8]
    outputs = run_scheduler(scheduler, runner)
    assert request.output_token_ids == reference and reference[-1] == end_id
    assert outputs["r"][-1].finish_reason == "stop"
    assert scheduler.block_manager.num_free_blocks == 32


# --- abort ---


def test_abort_works_in_every_state_and_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(
        num_blocks=12,
        block_size=4,
        max_num_tokens=8,
        max_input_len=16,
        policy="max_utilization",
        enable_chunked_context=True,
    )
    runner = FakeRunner(12, 4)
    waiting, chunking, decoding = make_requests(3, 6, max_tokens=20)
    chunking.prompt_token_ids = chunking.token_ids = make_prompt(1, 16)
    scheduler.add_request(decoding)
    _step(scheduler, runner)
    scheduler.add_request(chunking)
    _step(scheduler, runner)  # chunking: 7 of 16 prompt tokens computed
    scheduler.add_request(waiting)
    assert chunking.status == RequestStatus.RUNNING and 0 < chunking.num_computed_tokens < 16
    assert waiting.status == RequestStatus.WAITING
    for request in (waiting, chunking, decoding):
        output = scheduler.abort(request.request_id)
        assert output is not None and output.finished and output.finish_reason == "abort"
        assert request.status == RequestStatus.FINISHED_ABORTED and request.block_table == []
        check_blocks(scheduler)
    assert scheduler.abort("req-0") is None and scheduler.abort("unknown") is None
    assert scheduler.block_manager.num_free_blocks == 12 and not scheduler.has_unfinished()
    assert set(scheduler.schedule().finished_request_ids) == {"req-0", "req-1", "req-2"}


def test_abort_of_a_preempted_request_and_during_a_step() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, policy="max_utilization")
    runner = FakeRunner(6, 4)
    requests = make_requests(3, 4, max_tokens=12)
    for request in requests:
        scheduler.add_request(request)
    while not scheduler.metrics.num_preemptions:
        _step(scheduler, runner)
    preempted = scheduler.waiting[0]
    assert preempted.num_output_tokens > 0 and preempted.block_table == []
    aborted = scheduler.abort(preempted.request_id)
    assert aborted is not None and aborted.num_output_tokens == preempted.num_output_tokens
    scheduler_output = scheduler.schedule()
    runner_output = runner.execute(scheduler_output)
    victim = scheduler_output.scheduled[-1].request
    scheduler.abort(victim.request_id)  # while the step ran: its tokens are dropped
    outputs = scheduler.update(scheduler_output, runner_output)
    assert victim.request_id not in {o.request_id for o in outputs}
    check_blocks(scheduler)
    run_scheduler(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 6


# --- outputs, stats, runner contract ---


def test_outputs_stream_deltas_with_logprobs_and_final_stats() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner(64, 4)
    (request,) = make_requests(1, 5, max_tokens=4, logprobs=True)
    scheduler.add_request(request)
    outputs = run_scheduler(scheduler, runner)["req-0"]
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1, 1]
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 4
    assert [lp for o in outputs for lp in o.new_logprobs] == request.output_logprobs
    assert request.output_logprobs == [-t / 100.0 for t in request.output_token_ids]
    stats = outputs[-1].stats
    assert stats is not None and stats.ttft is not None and stats.queue_time is not None
    times = (stats.arrival_time, stats.first_scheduled_time, stats.first_token_time, stats.last_token_time)
    assert sorted(times) == list(times)  # type: ignore[type-var]
    snapshot = scheduler.stats()
    assert snapshot.num_requests_finished == {"length": 1}
    assert (snapshot.num_generated_tokens, snapshot.num_prompt_tokens, snapshot.num_steps) == (4, 5, 4)
    assert (snapshot.ttft.count, snapshot.itl.count, snapshot.e2e_latency.count) == (1, 3, 1)


def test_a_malformed_runner_output_fails_only_its_request() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner(64, 4)
    for request in make_requests(2, 4, max_tokens=2):
        scheduler.add_request(request)
    step = scheduler.schedule()
    runner_output = runner.execute(step)
    runner_output.sampled_token_ids[0] = [1, 2]  # two tokens without drafts
    outputs = scheduler.update(step, runner_output)
    assert outputs[0].finish_reason == "error" and "runner returned 2 tokens" in str(outputs[0].error)
    assert not outputs[1].finished
    check_blocks(scheduler)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_sliding_window_model_releases_blocks_behind_the_window_and_keeps_its_tokens(reuse: bool) -> None:
    """Released blocks go to other requests while their first owner keeps generating: every token still
    reads only its window, through the block table, so a block released too early changes the output."""
    window = 6
    scheduler = make_scheduler(
        num_blocks=16,
        block_size=4,
        attention_window=window,
        policy="max_utilization",
        enable_block_reuse=reuse,
    )
    runner = FakeRunner(16, 4, window=window)
    requests = make_requests(4, 10, max_tokens=24, prefix=make_prompt(900, 8) if reuse else None)
    for request in requests:
        scheduler.add_request(request)
    run_scheduler(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == reference_output(
            request.prompt_token_ids, request.sampling_params, window=window
        )
    assert sum(r.stats.num_blocks_released for r in requests) > 0
    # 4 sequences of 34 tokens need 36 blocks without the window; 16 suffice without preempting all the time
    assert scheduler.block_manager.num_free_blocks == 16
