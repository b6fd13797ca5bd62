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


def import_spec(engine_dir: Path, compute_capability: str | None = None) -> StageSpec:
    """The engine stage for an engine built elsewhere (`llmpipe package CONFIG --engine-dir DIR`): the
    trtllm-build output in `engine_dir`, checked against the config, with the fetched checkpoint's tokenizer.
    Its files' digests key reuse, so a rebuilt engine is imported again."""
    from pipeline.backends.trtllm.engine_import import engine_data_files, import_engine

    def produce_import(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
        from pipeline.stages.fetch import checkpoint_dir

        return import_engine(cfg, engine_dir, checkpoint_dir(inputs["fetch"]), out, compute_capability)

    def describe_import(cfg: BuildConfig, out: Path) -> list[str]:
        return [
            f"import the trtllm-build output {engine_dir} (config.json checked against the config's parallel, "
            f"engine, kv_cache, quantization and speculative sections) with the checkpoint's tokenizer -> {out}"
        ]

    return StageSpec(
        name="engine",
        config_sections=(*SPEC.config_sections, "quantization"),
        inputs=("fetch",),
        produce=produce_import,
        describe=describe_import,
        summary=f"Import the engine trtllm-build wrote into {engine_dir}.",
        data_files=lambda cfg: engine_data_files(engine_dir),
    )
