"""Options that several commands share, defined once: click settings, CONFIG with --set/--force/--dry-run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def overrides_option(
    example: str = "engine.max_batch_size=8",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--set KEY=VALUE (repeatable): a config field override, passed to load_build_config."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help=f"Override a config field, e.g. --set {example} (repeatable).",
    )


def config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--set, --force and --dry-run, shared by every command that runs stages."""
    func = click.option("--dry-run", is_flag=True, help="Print what would run, change nothing.")(func)
    func = click.option("--force", is_flag=True, help="Redo the stage(s) even when their manifest matches.")(
        func
    )
    func = overrides_option()(func)
    return click.argument("config", type=click.Path(dir_okay=False))(func)
