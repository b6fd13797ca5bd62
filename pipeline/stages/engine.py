"""build: the engine directory (config.json with build_config + weights), ready for the runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.backends import backend_step
from pipeline.config.build_config import BuildConfig
from pipeline.stages.runner import StageInput, StageSpec


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    build = backend_step(cfg.backend, "build")
    assert build is not None
    return dict(build(cfg, inputs["quantize"].dir, out))


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    e, kv = cfg.engine, cfg.kv_cache
    return [
        f"{cfg.backend}: build the engine (max_batch_size {e.max_batch_size}, max_seq_len {e.max_seq_len}, "
        f"max_num_tokens {e.max_num_tokens}, paged KV tokens_per_block {kv.tokens_per_block}) -> {out}"
    ]


SPEC = StageSpec(
    name="engine",
    config_sections=("backend", "dtype", "engine", "kv_cache", "scheduler", "speculative", "parallel"),
    inputs=("quantize",),
    produce=produce,
    describe=describe,
    summary="Build the engine (trtllm-build, or the torch engine directory).",
)
