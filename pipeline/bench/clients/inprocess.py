"""The in-process target: requests go straight to an EngineThread, no server, so comparing it with the
Triton target isolates serving overhead.

The Triton target's ensemble requests ask for each token's log-probability (its streamed text responses
count their tokens by them), and a log-probability needs the whole vocabulary's logits where a greedy
token alone does not (the engine's screening lm_head). `log_probs` asks the same of the engine here, so a
served run and an in-process run do the same work."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.bench.metrics import DraftCounts
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ServingError
from pipeline.runtime.engine.engine_args import EngineArgs


class InProcessTarget:
    def __init__(
        self,
        engine_thread: Any,  # pipeline.runtime.engine.async_engine.EngineThread
        name: str = "llmpipe-inprocess",
        min_tokens_equal_max: bool = True,
        end_id: int | None = None,
        log_probs: bool = False,
    ) -> None:
        self.engine_thread = engine_thread
        self.log_probs = log_probs
        self.name = name
        self.min_tokens_equal_max = min_tokens_equal_max
        self.end_id = end_id
        self._ids = itertools.count()
        # the engine's own speculation (its build config, or EngineArgs.speculation)
        self.speculates = engine_thread.engine.proposer is not None

    @classmethod
    def from_engine_dir(
        cls,
        engine_dir: str | Path,
        max_pending: int = 256,
        engine_args: EngineArgs | None = None,
        **kwargs: Any,
    ) -> InProcessTarget:
        """Load the engine with `engine_args` and start its thread; `close()` stops it."""
        from pipeline.runtime.engine.async_engine import EngineThread
        from pipeline.runtime.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir, engine_args)
        return cls(EngineThread(engine, max_pending=max_pending), **kwargs)

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        from pipeline.runtime.core.sampling_params import SamplingParams

        if request.input_ids is None:
            raise ValueError(f"request {request.index} has no input_ids (tokenize the workload first)")
        params = SamplingParams(
            max_tokens=request.output_tokens,
            min_tokens=request.output_tokens if self.min_tokens_equal_max else 0,
            temperature=0.0,
            end_id=self.end_id,
            logprobs=self.log_probs,
        )
        stream = self.engine_thread.submit(f"bench-{next(self._ids)}", list(request.input_ids), params)
        for output in stream:
            if output.finish_reason in ("error", "abort"):
                raise ServingError(
                    f"request ended with {output.finish_reason}: {output.error or 'no detail'}"
                )
            # Counted by their log-probs when asked for, as the ensemble's responses are counted.
            yield len(output.new_logprobs) if self.log_probs else len(output.new_token_ids)
            if self.speculates and output.stats is not None:
                yield DraftCounts(output.stats.num_draft_tokens, output.stats.num_accepted_draft_tokens)

    def close(self) -> None:
        self.engine_thread.shutdown()
