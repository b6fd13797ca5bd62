"""The stages in order, and the one loop that runs a prefix of them (for the CLI, benchmarks and validate)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pipeline.artifacts import require_manifest
from pipeline.config.build_config import BuildConfig
from pipeline.stages import convert, engine, fetch, package, quantize
from pipeline.stages.runner import StageInput, StageResult, StageSpec, run_stage, stage_dir

PIPELINE: tuple[StageSpec, ...] = (fetch.SPEC, convert.SPEC, quantize.SPEC, engine.SPEC, package.SPEC)
STAGES: dict[str, StageSpec] = {spec.name: spec for spec in PIPELINE}
STAGE_NAMES: tuple[str, ...] = tuple(STAGES)


def stages_until(until: str | None) -> tuple[StageSpec, ...]:
    """The stages from fetch through `until` (all of them for None)."""
    return PIPELINE if until is None else PIPELINE[: STAGE_NAMES.index(until) + 1]


def run_chain(
    cfg: BuildConfig,
    specs: tuple[StageSpec, ...],
    *,
    force: bool = False,
    report: Callable[[str], None] = lambda line: None,
) -> dict[str, StageResult]:
    """Run `specs` in order, each reused when its manifest matches; `report` gets a line before and after
    each stage."""
    results: dict[str, StageResult] = {}
    for index, spec in enumerate(specs, 1):
        start = time.monotonic()
        report(f"[{index}/{len(specs)}] {spec.name}: {spec.summary}")
        result = run_stage(cfg, spec, STAGES, force=force)
        verb = "reused (manifest matches; files verified)" if result.reused else "done"
        report(
            f"[{index}/{len(specs)}] {spec.name}: {verb} in {time.monotonic() - start:.1f}s -> {result.dir}"
        )
        results[spec.name] = result
    return results


def built_output(cfg: BuildConfig, stage: str) -> StageInput:
    """A stage's finished output; MissingArtifactError naming the command to run when it was never built."""
    folder = stage_dir(cfg, STAGES[stage])
    return StageInput(folder, require_manifest(folder, stage))
