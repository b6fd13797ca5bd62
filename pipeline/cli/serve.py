"""`llmpipe serve`: run tritonserver on a packaged model repository until Ctrl-C."""

from __future__ import annotations

import shlex
import time
from dataclasses import replace
from pathlib import Path

import click

from pipeline.cli.options import CONTEXT, overrides_option
from pipeline.errors import BackendUnavailableError, MissingArtifactError, ServingError
from pipeline.serving.server.command import ServerOptions, find_tritonserver, server_command
from pipeline.serving.server.launcher import TritonServer, failure_lines

DEFAULT_CONFIG = "build_configs/smollm2-135m.yaml"


def _check_backend_available(repo: Path) -> None:
    """A TensorRT-LLM repository needs NVIDIA's trtllm container; say so before tritonserver fails."""
    engine_config = repo / "tensorrt_llm" / "config.pbtxt"
    if not engine_config.is_file() or 'backend: "tensorrtllm"' not in engine_config.read_text(
        encoding="utf-8"
    ):
        return
    if find_tritonserver().bundled:
        raise BackendUnavailableError(
            f"{repo} serves a TensorRT-LLM engine (backend tensorrtllm), which the tritonserver bundled in "
            "nvidia-pytriton does not have",
            hint="Serve it in NVIDIA's tritonserver:<yy.mm>-trtllm-python-py3 container (`make image`), "
            "or package a torch build.",
        )


def _options_for(target: str, overrides: tuple[str, ...]) -> ServerOptions:
    """ServerOptions from a build config (its packaged repository and serving ports) or a repository folder."""
    path = Path(target)
    if path.is_dir():
        if not any(path.glob("*/config.pbtxt")):
            raise MissingArtifactError(
                f"{path} is not a Triton model repository (no */config.pbtxt)",
                hint="Pass a build config, or the model_repo folder `llmpipe package` wrote.",
            )
        return ServerOptions(model_repository=path.resolve())
    from pipeline.artifacts import require_manifest
    from pipeline.config.build_config import load_build_config
    from pipeline.config.workdir import stage_output_dir

    cfg = load_build_config(target, overrides)
    repo = stage_output_dir(cfg, "package")
    try:
        require_manifest(repo, "package")
    except MissingArtifactError as err:
        raise MissingArtifactError(
            f"{cfg.name} has no packaged model repository at {repo}",
            hint=f"Build it first: `llmpipe build {target}`.",
        ) from err
    s = cfg.serving
    return ServerOptions(
        model_repository=repo.resolve(),
        host=s.host,
        http_port=s.http_port,
        grpc_port=s.grpc_port,
        metrics_port=s.metrics_port,
        world_size=cfg.parallel.world_size if cfg.backend == "trtllm" else 1,
    )


@click.command("serve", context_settings=CONTEXT)
@click.argument("target", required=False, default=DEFAULT_CONFIG, metavar="[CONFIG|MODEL_REPO]")
@overrides_option("serving.http_port=9000")
@click.option(
    "--host", help="Bind address [serving.host, 127.0.0.1]. 0.0.0.0 exposes the server to the network."
)
@click.option(
    "--http-port", type=click.IntRange(0, 65535), help="HTTP port [serving.http_port]; 0 = any free port."
)
@click.option(
    "--grpc-port", type=click.IntRange(0, 65535), help="gRPC port [serving.grpc_port]; 0 = any free port."
)
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Metrics port [serving.metrics_port].")
@click.option(
    "--ready-timeout",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for every model to load.",
)
@click.option(
    "--log-verbose",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="tritonserver --log-verbose level.",
)
@click.option("--verbose", "-v", is_flag=True, help="Print tritonserver's log while it runs.")
@click.option("--dry-run", is_flag=True, help="Print the tritonserver command line and exit.")
def serve(
    target: str,
    overrides: tuple[str, ...],
    host: str | None,
    http_port: int | None,
    grpc_port: int | None,
    metrics_port: int | None,
    ready_timeout: float,
    log_verbose: int,
    verbose: bool,
    dry_run: bool,
) -> None:
    """Serve a packaged model repository with NVIDIA Triton until Ctrl-C.

    CONFIG serves build/<name>/model_repo with the config's serving.* ports; MODEL_REPO serves that
    folder (ports 8000/8001/8002 unless given). Uses the tritonserver on PATH, else the one bundled in nvidia-pytriton. Binds
    127.0.0.1 unless --host says otherwise; a model that fails to load stops the server with its log lines,
    and so does a model's Python stub that dies while serving (exit 1: Triton itself would go on
    reporting ready).

    \b
    Examples:
      llmpipe serve build_configs/smollm2-135m.yaml
      llmpipe serve build/tiny-llama/model_repo --http-port 9000 --grpc-port 9001 --metrics-port 9002
      llmpipe serve build_configs/smollm2-135m.yaml --dry-run
    \b
    Then, from another terminal:
      llmpipe generate "Write a haiku about GPUs" --stream
      curl -X POST localhost:8000/v2/models/ensemble/generate -d '{"text_input": "Hi", "max_tokens": 32}'
    """
    options = _options_for(target, overrides)
    _check_backend_available(options.model_repository)
    options = replace(
        options,
        log_verbose=log_verbose,
        host=options.host if host is None else host,
        http_port=options.http_port if http_port is None else http_port,
        grpc_port=options.grpc_port if grpc_port is None else grpc_port,
        metrics_port=options.metrics_port if metrics_port is None else metrics_port,
    )
    server = TritonServer(options, ready_timeout_s=ready_timeout, echo_log=verbose)
    if dry_run:
        _print_plan(server)
        return
    click.echo(f"starting tritonserver on {options.model_repository} ...", err=True)
    started = time.monotonic()
    with server:
        click.echo(_ready_banner(server, time.monotonic() - started), err=True)
        code = server.serve_forever()
        if server.health_failure is not None:
            logged = failure_lines(server.health_failure_log, limit=20)
            raise ServingError(
                f"{server.health_failure}, so llmpipe stopped tritonserver. Its log while serving:\n  "
                + ("\n  ".join(logged) if logged else "(nothing since it became ready)"),
                hint="Find what killed it (the kernel log shows the out-of-memory killer), then serve again.",
            )
        if not server.stopped_on_request:
            lines = "\n  ".join(server.log_lines()[-20:])
            raise ServingError(
                f"tritonserver exited with code {code} while serving:\n  {lines}",
                hint="Rerun with --verbose (and --log-verbose 1) to see the whole log.",
            )
    click.echo("tritonserver stopped.", err=True)


def _print_plan(server: TritonServer) -> None:
    install = find_tritonserver()
    backends = Path("<run dir>/backends") if install.bundled else None
    command = server_command(install.binary, server.options, backends, server.shm_prefix)
    click.echo(" ".join(shlex.quote(part) for part in command))


def _ready_banner(server: TritonServer, seconds: float) -> str:
    http = server.http_url
    return (
        f"ready in {seconds:.1f}s: {server.options.model_repository}\n"
        f"  HTTP     http://{http}   (POST /v2/models/ensemble/generate, /generate_stream)\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  metrics  {server.metrics_url}\n"
        f'  try:     llmpipe generate "Hello" --url {server.grpc_url} --stream\n'
        "Press Ctrl-C to stop."
    )
