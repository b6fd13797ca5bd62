"""Runs (or with --dry-run, describes) a chain of stages for the commands that build: build, each stage's
own command, package."""

from __future__ import annotations

import click

from pipeline.config.build_config import BuildConfig
from pipeline.stages.chain import PIPELINE, run_chain
from pipeline.stages.runner import StageSpec, stage_dir


def run_stages(cfg: BuildConfig, specs: tuple[StageSpec, ...], force: bool, dry_run: bool) -> None:
    if dry_run:
        click.echo(f"plan for {cfg.name} ({cfg.backend} backend):")
        for index, spec in enumerate(specs, 1):
            for line in _describe(cfg, spec):
                click.echo(f"  [{index}/{len(specs)}] {spec.name}: {line}")
        return
    results = run_chain(cfg, specs, force=force, report=lambda line: click.echo(line, err=True))
    if "package" in results:
        from pipeline.stages.package import serving_lines

        for line in serving_lines(cfg, results["package"].dir):
            click.echo(line, err=True)


def _describe(cfg: BuildConfig, spec: StageSpec) -> list[str]:
    lines = spec.describe(cfg, stage_dir(cfg, spec))
    # A backend's plan shows the calls a build makes (not an imported engine's stage, which builds nothing).
    if spec in PIPELINE and spec.name in ("convert", "quantize", "engine"):
        from pipeline.backends import backend_step

        plan = backend_step(cfg.backend, "plan")
        if plan is not None:
            lines = lines + [f"    {line}" for line in plan(cfg, stage_dir(cfg, spec).parent, spec.name)]
    return lines
