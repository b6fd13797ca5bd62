"""The builds a benchmark measures: find a config's stage outputs, or (scripts) run the pipeline's stages up
to the one needed, each reused when its manifest matches."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.errors import MissingArtifactError
from pipeline.stages.chain import STAGES, built_output, run_chain, stages_until
from pipeline.stages.fetch import checkpoint_dir
from pipeline.stages.runner import StageInput

PRECISION_OF_MODE = {
    "none": "fp32",
    "int8_wo": "int8",
    "int8_sq": "w8a8",
    "int4_wo": "int4",
    "int4_awq": "int4",
    "int4_gptq": "int4",
}


@dataclass(frozen=True)
class Build:
    cfg: BuildConfig
    hf_dir: Path  # the fetched HF checkpoint (tokenizer, peers' model)
    engine_dir: Path | None  # when the engine stage ran
    model_repo: Path | None  # when the package stage ran

    @property
    def precision(self) -> str:
        return precision_of(self.cfg)


def precision_of(cfg: BuildConfig) -> str:
    """The benchmark's name for a config's weight precision: fp32, bf16 (unquantized bfloat16), int8 (W8A16),
    w8a8 (int8_sq), int4."""
    mode = cfg.quantization.mode
    if mode == "none" and cfg.dtype == "bfloat16":
        return "bf16"
    return PRECISION_OF_MODE.get(mode, mode)


def ensure_built(config: str | Path, overrides: Sequence[str] = (), until: str = "engine") -> Build:
    cfg = load_build_config(str(config), list(overrides))
    results = run_chain(
        cfg, stages_until(until), report=lambda line: print(f"[{cfg.name}] {line}", file=sys.stderr)
    )
    dirs = {name: StageInput(result.dir, result.manifest) for name, result in results.items()}
    return Build(
        cfg=cfg,
        hf_dir=checkpoint_dir(dirs["fetch"]),
        engine_dir=dirs["engine"].dir if "engine" in dirs else None,
        model_repo=dirs["package"].dir if "package" in dirs else None,
    )


def stage_output(cfg: BuildConfig, stage: str) -> Path:
    """A stage's output folder; MissingArtifactError naming the command to run when it was never built."""
    return built_output(cfg, stage).dir


def packaged_repository(cfg: BuildConfig) -> Path:
    """The model repository packaged from exactly this config. A served run must not measure a repository
    packaged with other settings (say, a `--set serving.stream_interval=...` given to the benchmark only):
    MissingArtifactError naming the command that packages it."""
    package = STAGES["package"]
    built = built_output(cfg, package.name)
    if built.manifest.config_hash != cfg.config_hash(*package.config_sections):
        raise MissingArtifactError(
            f"the model repository at {built.dir} was packaged from other settings than this config's "
            f"({', '.join(package.config_sections)} sections, e.g. a --set given here)",
            hint="package it from the same config first: `llmpipe build CONFIG` with the same --set options",
        )
    return built.dir


def fetched_checkpoint(cfg: BuildConfig) -> Path:
    return checkpoint_dir(built_output(cfg, "fetch"))


def gguf_source(cfg: BuildConfig) -> Path | None:
    """The GGUF file the config builds from, if its source is one (the llama.cpp peers start there)."""
    if cfg.source.kind != "gguf":
        return None
    from pipeline.stages.fetch import gguf_file

    return gguf_file(cfg)
