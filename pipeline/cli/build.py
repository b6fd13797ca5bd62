"""`llmpipe build` and one command per stage (fetch, convert, quantize, engine, package)."""

from __future__ import annotations

import click

from pipeline.cli.options import CONTEXT, config_options
from pipeline.cli.stage_run import run_stages
from pipeline.config.build_config import load_build_config
from pipeline.stages.chain import PIPELINE, stages_until
from pipeline.stages.runner import StageSpec


@click.command(context_settings=CONTEXT)
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
    specs = stages_until(until)
    if cfg.backend == "trtllm" and not dry_run:
        from pipeline.backends.trtllm.api import stages_need_trtllm
        from pipeline.backends.trtllm.env import require_trtllm

        if stages_need_trtllm(cfg, (spec.name for spec in specs)):
            require_trtllm()  # stop before a long Hub download on a host that cannot build anyway
    run_stages(cfg, specs, force, dry_run)


def _stage_command(spec: StageSpec) -> click.Command:
    def command(config: str, overrides: tuple[str, ...], force: bool, dry_run: bool) -> None:
        cfg = load_build_config(config, overrides)
        run_stages(cfg, (spec,), force, dry_run)

    command.__doc__ = (
        f"{spec.summary}\n\n    Reads the outputs of: {', '.join(spec.inputs) or 'nothing (first stage)'}; "
        f"writes build/<name>/{spec.dirname}/.\n\n    \b\n    Example:\n"
        f"      llmpipe {spec.name} build_configs/tiny-llama.yaml --force\n"
    )
    return click.command(spec.name, context_settings=CONTEXT)(config_options(command))


def _command_for(spec: StageSpec) -> click.Command:
    if spec.name == "package":  # its own module: it also packages an engine built elsewhere
        from pipeline.cli.package import package

        return package
    return _stage_command(spec)


STAGE_COMMANDS: tuple[click.Command, ...] = tuple(_command_for(spec) for spec in PIPELINE)
