"""The pipeline's stages, in order. Each module exposes SPEC; none imports Click."""

from __future__ import annotations

from pipeline.stages import build, convert, fetch, package, quantize
from pipeline.stages.runner import StageSpec

PIPELINE: tuple[StageSpec, ...] = (fetch.SPEC, convert.SPEC, quantize.SPEC, build.SPEC, package.SPEC)
STAGES: dict[str, StageSpec] = {spec.name: spec for spec in PIPELINE}
