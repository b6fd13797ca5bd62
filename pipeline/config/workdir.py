"""Where a build's outputs live: the work dir and the folder each stage writes in it."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.errors import MissingArtifactError

# The folder each stage writes under the work dir. The stage specs and every reader of a built output
# (serve, bench, a draft model's engine) take the names from here.
STAGE_DIRNAMES: dict[str, str] = {
    "fetch": "hf",
    "convert": "checkpoint",
    "quantize": "quantized",
    "engine": "engine",
    "package": "model_repo",
    "validate": "validation",
}


def resolve_workdir(cfg: BuildConfig) -> Path:
    return Path(cfg.workdir).expanduser() if cfg.workdir else Path("build") / cfg.name


def stage_output_dir(cfg: BuildConfig, stage: str) -> Path:
    return resolve_workdir(cfg) / STAGE_DIRNAMES[stage]


def draft_engine_dir(cfg: BuildConfig, *, require_built: bool = True) -> tuple[BuildConfig, Path]:
    """(the draft model's build config, its engine directory, resolved) for speculative.mode=draft_model;
    speculative.draft_config is read from the current directory. With `require_built`, a draft engine that
    was never built (no config.json) is a MissingArtifactError naming the build to run first."""
    draft_config = cfg.speculative.draft_config
    assert draft_config is not None  # the config validator requires it for mode=draft_model
    draft = load_build_config(draft_config)
    engine_dir = stage_output_dir(draft, "engine").resolve()
    if require_built and not (engine_dir / "config.json").is_file():
        raise MissingArtifactError(
            f"speculative.draft_config={draft_config} has no engine at {engine_dir}",
            hint=f"Build the draft model first: llmpipe build {draft_config}",
        )
    return draft, engine_dir
