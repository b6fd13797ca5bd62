"""The builds a benchmark measures: find a config's stage outputs, or (scripts) run the pipeline's stages up
to the one needed, each reused when its manifest matches."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import require_manifest
from pipeline.config import BuildConfig, load_build_config
from pipeline.stages import PIPELINE, STAGES
from pipeline.stages.fetch import checkpoint_dir
from pipeline.stages.runner import StageInput, run_stage, stage_dir

PRECISION_OF_MODE = {
    "none": "fp32",
    "int8_wo": "int8",
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
        mode = self.cfg.quantization.mode
        if mode == "none" and self.cfg.dtype == "bfloat16":
            return "bf16"
        return PRECISION_OF_MODE.get(mode, mode)


def ensure_built(config: str | Path, overrides: Sequence[str] = (), until: str = "engine") -> Build:
    cfg = load_build_config(str(config), list(overrides))
    names = [spec.name for spec in PIPELINE]
    dirs: dict[str, StageInput] = {}
    for spec in PIPELINE[: names.index(until) + 1]:
        start = time.monotonic()
        result = run_stage(cfg, spec, STAGES)
        verb = "reused" if result.reused else "built"
        print(
            f"[{cfg.name}] {spec.name}: {verb} in {time.monotonic() - start:.1f}s -> {result.dir}",
            file=sys.stderr,
        )
        dirs[spec.name] = StageInput(result.dir, result.manifest)
    return Build(
        cfg=cfg,
        hf_dir=checkpoint_dir(dirs["fetch"]),
        engine_dir=dirs["engine"].dir if "engine" in dirs else None,
        model_repo=dirs["package"].dir if "package" in dirs else None,
    )


def stage_output(cfg: BuildConfig, stage: str) -> Path:
    """A stage's output folder; MissingArtifactError naming the command to run when it was never built."""
    folder = stage_dir(cfg, STAGES[stage])
    require_manifest(folder, stage)
    return folder


def fetched_checkpoint(cfg: BuildConfig) -> Path:
    folder = stage_output(cfg, "fetch")
    return checkpoint_dir(StageInput(folder, require_manifest(folder, "fetch")))


def gguf_source(cfg: BuildConfig) -> Path | None:
    """The GGUF file the config builds from, if its source is one (the llama.cpp peers start there)."""
    if cfg.source.kind != "gguf":
        return None
    from pipeline.stages.fetch import gguf_file

    return gguf_file(cfg)
