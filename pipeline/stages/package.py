"""package: render the Triton model repository of serving.interface (inflight_batcher_llm or llmapi)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig
from pipeline.stages.runner import StageInput, StageSpec


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    if cfg.backend == "trtllm_pytorch":
        from pipeline.serving.repository.trtllm_pytorch import render_trtllm_pytorch_repository as render
    else:
        from pipeline.serving.repository.render import render_model_repository as render

    facts = dict(render(cfg, inputs["engine"].dir, out))
    # `llmpipe serve MODEL_REPO` rebuilds the config from here: a TensorRT-LLM engine is checked against
    # it (and the launch sized by its tp/pp) before Triton starts.
    facts["build_config"] = cfg.model_dump(mode="json")
    return facts


def _template_files() -> dict[str, Path]:
    from pipeline.serving.repository.render import template_files

    return template_files()


def serving_lines(cfg: BuildConfig, out: Path) -> list[str]:
    """How to serve the repository in `out`: what `llmpipe package` and `build` print after it and in the plan."""
    lines = [f"serve it with Triton: llmpipe serve {out}"]
    if cfg.backend == "trtllm_pytorch":
        from pipeline.backends.trtllm_pytorch.package import TRTLLM_SERVE_SCRIPT

        lines.append(
            f"or with TensorRT-LLM's own OpenAI-compatible server (trtllm-serve): {out / TRTLLM_SERVE_SCRIPT}"
        )
    return lines


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    from pipeline.serving.repository.render import repository_models

    s = cfg.serving
    if cfg.backend == "trtllm_pytorch":
        from pipeline.backends.trtllm_pytorch.package import UPSTREAM_MODEL_DIR, UPSTREAM_MODEL_ENV

        engine = (
            f"TensorRT-LLM's llmapi model.py from the serving image ({UPSTREAM_MODEL_DIR}, or "
            f"${UPSTREAM_MODEL_ENV}) on the checkpoint linked into tensorrt_llm/1/checkpoint"
        )
    else:
        engine = f"backend {'tensorrtllm' if cfg.backend == 'trtllm' else 'python'}"
    return [
        f"render model repository ({s.interface}) -> {out}: {', '.join(repository_models(cfg))} "
        f"(tensorrt_llm: {engine}, decoupled {str(s.decoupled).lower()})",
        *serving_lines(cfg, out),
    ]


SPEC = StageSpec(
    name="package",
    config_sections=("backend", "serving", "engine", "kv_cache", "scheduler", "speculative"),
    inputs=("engine",),
    produce=produce,
    describe=describe,
    summary="Write the Triton model repository for the engine.",
    data_files=lambda cfg: _template_files(),
)
