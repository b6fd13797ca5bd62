"""The `llmpipe` command line: thin commands that parse options, load the config and call stages."""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import click
import yaml

from pipeline import __version__
from pipeline.config import BuildConfig, load_build_config
from pipeline.errors import PipelineError
from pipeline.stages import PIPELINE, STAGES
from pipeline.stages.runner import StageSpec, run_stage, stage_dir

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--set, --force and --dry-run, shared by every command that runs stages."""
    func = click.option("--dry-run", is_flag=True, help="Print what would run, change nothing.")(func)
    func = click.option("--force", is_flag=True, help="Redo the stage(s) even when their manifest matches.")(
        func
    )
    func = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set engine.max_batch_size=8 (repeatable).",
    )(func)
    return click.argument("config", type=click.Path(dir_okay=False))(func)


class _Cli(click.Group):
    """Turns user-fixable errors into one line plus a hint (exit 1); bugs keep their traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PipelineError as err:
            if os.environ.get("LLMPIPE_DEBUG") == "1":
                raise
            click.echo(f"Error: {err.message}", err=True)
            if err.hint:
                click.echo(f"Hint: {err.hint}", err=True)
            click.echo("(set LLMPIPE_DEBUG=1 for the traceback)", err=True)
            ctx.exit(err.exit_code)


@click.group(cls=_Cli, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="llmpipe")
def cli() -> None:
    """llmpipe: Hugging Face checkpoint -> quantized in-flight-batching engine -> Triton model repository.

    \b
    Quick start (offline, CPU):
      llmpipe build build_configs/smollm2-135m.yaml     # fetch, convert, quantize, engine, package
      llmpipe serve build_configs/smollm2-135m.yaml     # tritonserver on 127.0.0.1:8000/8001
      llmpipe generate "Write a haiku about GPUs" --stream

    Every stage writes build/<name>/<stage>/ with a manifest.json; a stage whose manifest matches the
    config and its inputs is reused. Set LLMPIPE_DEBUG=1 to see tracebacks.
    """


def _run_stages(cfg: BuildConfig, specs: tuple[StageSpec, ...], force: bool, dry_run: bool) -> None:
    if dry_run:
        click.echo(f"plan for {cfg.name} ({cfg.backend} backend):")
        for index, spec in enumerate(specs, 1):
            for line in _describe(cfg, spec):
                click.echo(f"  [{index}/{len(specs)}] {spec.name}: {line}")
        return
    for index, spec in enumerate(specs, 1):
        start = time.monotonic()
        click.echo(f"[{index}/{len(specs)}] {spec.name}: {spec.summary}", err=True)
        result = run_stage(cfg, spec, STAGES, force=force)
        verb = "reused (manifest matches; files verified)" if result.reused else "done"
        click.echo(
            f"[{index}/{len(specs)}] {spec.name}: {verb} in {time.monotonic() - start:.1f}s -> {result.dir}",
            err=True,
        )


def _describe(cfg: BuildConfig, spec: StageSpec) -> list[str]:
    lines = spec.describe(cfg, stage_dir(cfg, spec))
    if cfg.backend == "trtllm" and spec.name in ("convert", "quantize", "engine"):
        from pipeline.backends import backend_step

        plan = backend_step("trtllm", "plan")
        if plan is not None:
            lines = lines + [f"    {line}" for line in plan(cfg, stage_dir(cfg, spec).parent, spec.name)]
    return lines


@cli.command(context_settings=CONTEXT)
@click.option("--until", type=click.Choice([s.name for s in PIPELINE]), help="Stop after this stage.")
@config_options
def build(config: str, overrides: tuple[str, ...], force: bool, dry_run: bool, until: str | None) -> None:
    """Run every stage: fetch -> convert -> quantize -> engine -> package.

    \b
    Examples:
      llmpipe build build_configs/tiny-llama.yaml
      llmpipe build build_configs/smollm2-135m.yaml --set quantization.mode=int8_wo
      llmpipe build build_configs/llama3-8b-int4-awq-tp2.yaml --dry-run
    """
    cfg = load_build_config(config, overrides)
    if cfg.backend == "trtllm" and not dry_run:
        from pipeline.backends.trtllm.env import require_trtllm

        require_trtllm()  # stop before a long Hub download on a host that cannot build anyway
    names = [s.name for s in PIPELINE]
    specs = PIPELINE[: names.index(until) + 1] if until else PIPELINE
    _run_stages(cfg, specs, force, dry_run)


def _stage_command(spec: StageSpec) -> click.Command:
    def command(config: str, overrides: tuple[str, ...], force: bool, dry_run: bool) -> None:
        cfg = load_build_config(config, overrides)
        _run_stages(cfg, (spec,), force, dry_run)

    command.__doc__ = (
        f"{spec.summary}\n\n    Reads the outputs of: {', '.join(spec.inputs) or 'nothing (first stage)'}; "
        f"writes build/<name>/{spec.dirname}/.\n\n    \b\n    Example:\n"
        f"      llmpipe {spec.name} build_configs/tiny-llama.yaml --force\n"
    )
    return click.command(spec.name, context_settings=CONTEXT)(config_options(command))


for _spec in PIPELINE:
    cli.add_command(_stage_command(_spec))


@cli.group(context_settings=CONTEXT)
def config() -> None:
    """Inspect and check build configs (build_configs/*.yaml)."""


@config.command("show", context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of YAML.")
def config_show(file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print the resolved config: the file, overrides and every default.

    \b
    Example:
      llmpipe config show build_configs/smollm2-135m.yaml --set kv_cache.enable_block_reuse=true
    """
    data = load_build_config(file, overrides).model_dump(mode="json")
    click.echo(json.dumps(data, indent=2) if as_json else yaml.safe_dump(data, sort_keys=False))


@config.command("validate", context_settings=CONTEXT)
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field (repeatable).")
def config_validate(files: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Check configs without running anything; exit 1 if any is invalid.

    \b
    Example:
      llmpipe config validate build_configs/*.yaml
    """
    failed = 0
    for file in files:
        try:
            load_build_config(file, overrides)
            click.echo(f"ok      {file}")
        except PipelineError as err:
            failed += 1
            click.echo(f"invalid {err}", err=True)
    if failed:
        raise SystemExit(1)


# Commands owned by other modules; each module exposes one click command named after it.
_EXTERNAL_COMMANDS = ("serve", "generate", "validate", "bench", "doctor", "inspect")


def _register_external_commands() -> None:
    for name in _EXTERNAL_COMMANDS:
        try:
            module = importlib.import_module(f"pipeline.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"pipeline.commands.{name}":
                continue
            raise
        cli.add_command(getattr(module, name))


_register_external_commands()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="llmpipe")
