"""`llmpipe config show|validate`: the resolved build config, and checks without running anything."""

from __future__ import annotations

import json

import click
import yaml

from pipeline.cli.options import CONTEXT, overrides_option
from pipeline.config.build_config import load_build_config
from pipeline.errors import PipelineError


@click.group(context_settings=CONTEXT)
def config() -> None:
    """Inspect and check build configs (build_configs/*.yaml)."""


@config.command("show", context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False))
@overrides_option()
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
@overrides_option()
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
