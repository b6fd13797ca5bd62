"""The scheduler's logits plumbing with fabricated runner outputs: context logits kept in position order
across prompt chunks and a preemption's recompute, sent once with the first token; a cached prefix is
recomputed for a request that wants them; generation logits cut with the tokens at a stop."""

from __future__ import annotations

import numpy as np

from pipeline.runtime.core.outputs import LogitsRows, RunnerOutput, SchedulerOutput
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from tests.helpers import make_scheduler

VOCAB = 5


def _rows(start: int, count: int) -> np.ndarray:
    """Row i holds position start + i in every column, so the positions can be read back."""
    return np.repeat(np.arange(start, start + count, dtype=np.float32)[:, None], VOCAB, axis=1)


def _runner_output(out: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What the model runner returns for `out`: every prompt position's logits, one token per sampled row."""
    sampled, context, generation = [], [], []
    for sched in out.scheduled:
        request = sched.request
        start = request.num_computed_tokens
        end = min(start + sched.num_new_tokens, request.num_prompt_tokens)
        context.append(LogitsRows(start, _rows(start, end - start)) if end > start else None)
        sampled.append([token] if sched.sample else [])
        generation.append(_rows(100 + request.num_tokens, 1) if sched.sample else None)
    return RunnerOutput(sampled, context_logits=context, generation_logits=generation)


def test_context_logits_cover_each_prompt_position_once_across_chunks_and_recompute() -> None:
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_context=True, policy="max_utilization")
    params = SamplingParams(max_tokens=3, temperature=0.0, context_logits=True, generation_logits=True)
    request = Request("r", list(range(10, 30)), params)
    scheduler.add_request(request)
    outputs = []
    for step in range(2):  # two chunks of 8 of the 20-token prompt
        out = scheduler.schedule()
        outputs += scheduler.update(out, _runner_output(out))
        assert request.num_context_logits == 8 * (step + 1)
    # preempted mid-prompt: the recompute starts from 0 and the positions already held are not repeated
    scheduler._preempt(request, SchedulerOutput())
    while not request.status.finished:
        out = scheduler.schedule()
        outputs += scheduler.update(out, _runner_output(out))
    (first, *rest) = [o for o in outputs if o.new_token_ids]
    context = np.concatenate(first.context_logits)
    assert context[:, 0].tolist() == list(range(20))
    assert all(o.context_logits is None for o in rest) and request.context_logits == []
    generation = np.concatenate([o.new_generation_logits for o in [first, *rest]])
    assert generation[:, 0].tolist() == [120, 121, 122]


def test_a_cached_prefix_is_recomputed_for_context_logits() -> None:
    scheduler = make_scheduler(enable_block_reuse=True)
    prompt = list(range(10, 26))
    for request_id, params in (
        ("plain", SamplingParams(max_tokens=1)),
        ("again", SamplingParams(max_tokens=1)),
        ("logits", SamplingParams(max_tokens=1, context_logits=True)),
    ):
        request = Request(request_id, prompt, params)
        scheduler.add_request(request)
        out = scheduler.schedule()
        (sched,) = out.scheduled
        scheduler.update(out, _runner_output(out))
        computed = {"plain": 16, "again": 4, "logits": 16}[request_id]  # "again" reuses 3 of 4 blocks
        assert sched.num_new_tokens == computed


def test_generation_logits_are_cut_with_the_tokens_at_a_stop() -> None:
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=4, end_id=7, generation_logits=True)
    scheduler.add_request(Request("r", [1, 2, 3], params))
    out = scheduler.schedule()
    runner_output = RunnerOutput([[7]], generation_logits=[_rows(0, 2)])  # a row past the stop is dropped
    (output,) = scheduler.update(out, runner_output)
    assert output.finished and output.new_generation_logits.shape == (1, VOCAB)


def test_a_recompute_with_other_chunk_edges_keeps_each_position_once() -> None:
    request = Request("r", list(range(10, 30)), SamplingParams(context_logits=True))
    request.add_context_logits(0, _rows(0, 5))
    request.add_context_logits(0, _rows(0, 8))  # after a preemption, in chunks of 8
    request.add_context_logits(8, _rows(8, 8))
    request.add_context_logits(20, _rows(20, 0))
    assert np.concatenate(request.context_logits)[:, 0].tolist() == list(range(16))
