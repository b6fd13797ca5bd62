"""Property-style scheduler test: random workloads (fixed seeds) of arrivals, aborts, drafts and stops
under every policy x chunking x reuse combination, checked every step and against the reference."""

from __future__ import annotations

import random

import pytest

from pipeline.config.vocab import SCHEDULER_POLICIES
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from tests.helpers import (
    WRONG_TOKEN,
    FakeRunner,
    check_blocks,
    check_step_limits,
    make_prompt,
    make_scheduler,
    reference_output,
)


@pytest.mark.parametrize("seed", range(32))
def test_random_workloads_respect_budgets_leak_no_blocks_and_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    # Every policy x chunking x reuse combination gets 4 seeds; the rest is drawn.
    policy, chunked, reuse = SCHEDULER_POLICIES[seed % 2], bool(seed // 2 % 2), bool(seed // 4 % 2)
    block_size = rng.choice([1, 2, 4, 8])
    max_num_tokens = rng.randint(8, 48)
    max_input_len = rng.randint(4, 48) if chunked else max_num_tokens
    max_seq_len = max_input_len + rng.randint(1, 24)
    min_blocks = -(-max_seq_len // block_size)  # one longest sequence must fit
    num_blocks = rng.randint(min_blocks, min_blocks * 3 // 2)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_size=rng.randint(1, 6),
        max_num_tokens=max_num_tokens,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        policy=policy,
        enable_chunked_context=chunked,
        enable_block_reuse=reuse,
    )
    runner = FakeRunner(num_blocks, block_size)
    prefix = make_prompt(999, rng.randint(0, max_input_len // 2))
    arrivals: dict[int, list[Request]] = {}
    for i in range(24):
        prompt = make_prompt(i, rng.randint(1, max_input_len), prefix if rng.random() < 0.5 else None)
        prompt = prompt[:max_input_len] or [1]
        params = SamplingParams(
            max_tokens=rng.randint(1, max_seq_len - len(prompt)),
            end_id=rng.choice([None, 3, 7]),
            min_tokens=0,
        )
        arrivals.setdefault(rng.randint(0, 20), []).append(Request(f"r{i}", prompt, params))
    requests = [r for batch in arrivals.values() for r in batch]
    references = {
        r.request_id: reference_output(r.prompt_token_ids, r.sampling_params, max_seq_len) for r in requests
    }
    aborted: set[str] = set()
    for step in range(5000):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished() and not arrivals:
            break
        if rng.random() < 0.05 and scheduler.running + list(scheduler.waiting):
            victim = rng.choice(scheduler.running + list(scheduler.waiting))
            assert scheduler.abort(victim.request_id) is not None
            aborted.add(victim.request_id)
            check_blocks(scheduler)
        for request in scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1 and rng.random() < 0.5:
                reference = references[request.request_id]
                drafts = reference[request.num_output_tokens : request.num_output_tokens + rng.randint(1, 4)]
                if drafts and rng.random() < 0.5:
                    drafts[rng.randrange(len(drafts))] = WRONG_TOKEN
                request.draft_token_ids = drafts
        if scheduler.has_unfinished():
            scheduler_output = scheduler.schedule()
            check_step_limits(scheduler, scheduler_output)
            scheduler.update(scheduler_output, runner.execute(scheduler_output))
            check_blocks(scheduler)
    assert not scheduler.has_unfinished() and not arrivals
    bm = scheduler.block_manager
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    if scheduler.config.policy == "guaranteed_no_evict":
        assert scheduler.metrics.num_preemptions == 0
    for request in requests:
        reference = references[request.request_id]
        if request.request_id in aborted:
            assert request.output_token_ids == reference[: request.num_output_tokens]
        else:
            assert request.output_token_ids == reference, request.request_id
