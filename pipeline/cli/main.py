"""The `llmpipe` command line: the group, the error boundary, and the commands it holds (one module each)."""

from __future__ import annotations

import os
from typing import Any

import click

from pipeline import __version__
from pipeline.cli.bench import bench
from pipeline.cli.build import STAGE_COMMANDS, build
from pipeline.cli.config import config
from pipeline.cli.deploy import deploy
from pipeline.cli.doctor import doctor
from pipeline.cli.generate import generate
from pipeline.cli.inspect import inspect
from pipeline.cli.openai_server import openai_server
from pipeline.cli.options import CONTEXT
from pipeline.cli.serve import serve
from pipeline.cli.validate import validate
from pipeline.errors import PipelineError
from pipeline.util.openmp import default_wait_policy


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


for _command in (build, *STAGE_COMMANDS, config, serve, generate, validate, bench, doctor, inspect, deploy):
    cli.add_command(_command)
cli.add_command(openai_server)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    default_wait_policy(os.environ)  # before any command loads torch
    cli.main(args=argv, prog_name="llmpipe")
