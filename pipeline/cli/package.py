"""`llmpipe package`: render the Triton model repository, for the engine stage's output or for an engine
trtllm-build wrote elsewhere (`--engine-dir`)."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import CONTEXT, config_options
from pipeline.cli.stage_run import run_stages
from pipeline.config.build_config import load_build_config
from pipeline.stages import engine, fetch
from pipeline.stages import package as package_stage
from pipeline.stages.runner import StageSpec


@click.command("package", context_settings=CONTEXT)
@click.option(
    "--engine-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder trtllm-build wrote (config.json + rank<N>.engine) to package instead of building one "
    "(backend trtllm). The config must state what it was built with; the tokenizer comes from the "
    "config's source.",
)
@click.option(
    "--compute-capability",
    metavar="MAJOR.MINOR",
    help="With --engine-dir: compute capability of the GPU that built it (nvidia-smi "
    "--query-gpu=compute_cap), which serving compares with its GPUs; default: this machine's GPU.",
)
@config_options
def package(
    config: str,
    overrides: tuple[str, ...],
    force: bool,
    dry_run: bool,
    engine_dir: Path | None,
    compute_capability: str | None,
) -> None:
    """Write the Triton model repository for the engine.

    Reads the engine stage's output (build/<name>/engine/) and writes build/<name>/model_repo/. With
    --engine-dir, an engine built by your own trtllm-build run is packaged: the folder's config.json is
    checked against the config (parallel tp/pp, engine limits, tokens_per_block, quantization, draft
    length; every mismatch is named with both values), its files become the engine stage's output (hard
    links) with the tokenizer of the config's source checkpoint (fetched first), and the manifest records
    where it came from and its TensorRT-LLM version. The config's engine, kv_cache and scheduler sections
    set the Triton parameters, as for a build. Then `llmpipe serve CONFIG`.

    \b
    Examples:
      llmpipe package build_configs/tiny-llama.yaml --force
      llmpipe package my-llama.yaml --engine-dir /engines/llama-8b-tp2 --compute-capability 9.0
      llmpipe package my-llama.yaml --engine-dir /engines/llama-8b-tp2 --dry-run
    """
    if compute_capability is not None and engine_dir is None:
        raise click.UsageError("--compute-capability describes an --engine-dir; pass both or neither")
    cfg = load_build_config(config, overrides)
    specs: tuple[StageSpec, ...] = (package_stage.SPEC,)
    if engine_dir is not None:
        specs = (fetch.SPEC, engine.import_spec(engine_dir.resolve(), compute_capability), package_stage.SPEC)
    run_stages(cfg, specs, force, dry_run)
