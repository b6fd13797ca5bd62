"""Decode speed of an in-process engine: greedy requests of fixed length, decode separated from prefill.

"decode" counts the output tokens made after every request has its first one (all prefills done) over
that time; "end-to-end" counts every output token over the whole run. Tokens per process CPU-second are
reported beside the wall-clock rates: on a small shared CPU they depend much less on other processes.
"""

from __future__ import annotations

import random
import time
from typing import Any

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def decode_speed(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Run `prompts` together to `new_tokens` outputs each (no end id) and time them."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    started = time.perf_counter()
    requests = [engine.add_request(f"bench-{started}-{i}", p, params) for i, p in enumerate(prompts)]
    decode_start: tuple[float, float, int] | None = None  # wall time, CPU time, tokens so far
    while engine.has_unfinished():
        engine.step()
        if decode_start is None and all(r.num_output_tokens >= 1 for r in requests):
            decode_start = (
                time.perf_counter(),
                time.process_time(),
                sum(r.num_output_tokens for r in requests),
            )
    ended, cpu_ended = time.perf_counter(), time.process_time()
    total = sum(r.num_output_tokens for r in requests)
    assert decode_start is not None
    decode_tokens = total - decode_start[2]
    return {
        "output_tokens": total,
        "seconds": round(ended - started, 3),
        "end_to_end_tok_s": round(total / (ended - started), 1),
        "decode_tok_s": round(decode_tokens / (ended - decode_start[0]), 1),
        "decode_tok_per_cpu_s": round(decode_tokens / (cpu_ended - decode_start[1]), 1),
    }
