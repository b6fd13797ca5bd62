"""The built engine, in-process: greedy generation through the real scheduler and paged KV cache, and
teacher-forced scoring (logits at every position of a given sequence) through `ModelRunner.score`: the
same weights, linear layers, attention and KV-cache format that serve requests.

NOTE: scoring takes its blocks from the engine's block manager (the only writer of block tables) and gives
them back after; it needs the engine idle (no request in flight), which validation guarantees by scoring
only between `generate` calls.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import ConfigError
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.worker.model_runner import ModelRunner


class EngineTarget:
    def __init__(self, engine: LLMEngine, name: str = "engine (in-process)") -> None:
        if not isinstance(engine.runner, ModelRunner):
            raise TypeError(f"scoring needs the engine's ModelRunner, got {type(engine.runner).__name__}")
        self.engine = engine
        self.runner = engine.runner
        self.name = name
        build = self.runner.config.build
        # one prefill of the whole sequence: bounded by the prompt limit the engine was built for
        self.max_input_len = build.max_input_len

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> EngineTarget:
        return cls(LLMEngine.from_engine_dir(engine_dir), name=f"engine {engine_dir}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=0.0,
            end_id=stop_ids[0] if stop_ids else None,
            stop_token_ids=tuple((i,) for i in stop_ids[1:]),
        )
        for prompt in prompts:
            self._check_length(len(prompt), "prompt")
        return [request.output_token_ids for request in self.engine.generate(prompts, params)]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position: row i predicts token i+1. [len(token_ids), vocab] fp32 on CPU."""
        self._check_length(len(token_ids), "scored sequence")
        if self.engine.has_unfinished():
            raise RuntimeError("EngineTarget.score needs an idle engine (its KV blocks are borrowed)")
        block_manager = self.engine.scheduler.block_manager
        request = Request("validate-score", list(token_ids), SamplingParams())
        if not block_manager.can_allocate(request):
            raise ConfigError(
                f"the engine's KV cache cannot hold one {len(token_ids)}-token sequence for scoring",
                hint="raise kv_cache.max_tokens",
            )
        block_manager.allocate(request)
        try:
            return self.runner.score(token_ids, request.block_table).cpu()
        finally:
            block_manager.free(request)

    def _check_length(self, num_tokens: int, what: str) -> None:
        if num_tokens > self.max_input_len:
            raise ConfigError(
                f"a {what} of the eval set has {num_tokens} tokens, more than the engine's max_input_len "
                f"({self.max_input_len})",
                hint="rebuild with a larger engine.max_input_len or lower validation.max_new_tokens",
            )
