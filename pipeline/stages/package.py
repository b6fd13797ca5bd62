"""package: render the Triton model repository of serving.interface (inflight_batcher_llm or llmapi)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig
from pipeline.stages.runner import StageInput, StageSpec


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    from pipeline.serving.repository.render import render_model_repository

    facts = dict(render_model_repository(cfg, inputs["engine"].dir, out))
    # `llmpipe serve MODEL_REPO` rebuilds the config from here: a TensorRT-LLM engine is checked against
    # it (and the launch sized by its tp/pp) before Triton starts.
    facts["build_config"] = cfg.model_dump(mode="json")
    return facts


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    from pipeline.serving.repository.render import repository_models

    s = cfg.serving
    backend = "tensorrtllm" if cfg.backend == "trtllm" else "python"
    return [
        f"render model repository ({s.interface}) -> {out}: {', '.join(repository_models(cfg))} "
        f"(tensorrt_llm: backend {backend}, decoupled {str(s.decoupled).lower()})"
    ]


SPEC = StageSpec(
    name="package",
    config_sections=("backend", "serving", "engine", "kv_cache", "scheduler", "speculative"),
    inputs=("engine",),
    produce=produce,
    describe=describe,
    summary="Write the Triton model repository for the engine.",
)
